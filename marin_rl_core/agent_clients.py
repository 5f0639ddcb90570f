"""``openai`` clients for agent programs that run in the rollout worker's process.

An in-process agent (an ``AgentEnv.run_agent`` that talks to its
:class:`~marin_rl_core.types.AgentEndpoint` itself) needs an ``openai.OpenAI`` or
``openai.AsyncOpenAI`` pointed at the episode's base URL and key. Two obvious ways cost more than
the episode's calls:

* a client of its own per episode loads the system's CA certificates when it is built (about
  30 ms here, more than a short episode's calls);
* one client shared by all episodes (``client.with_options(base_url=..., api_key=...)`` per
  episode) shares one connection pool, and the pool scans all its connections for every request
  and every response it hands back: with hundreds of concurrent episodes that scan was a third of
  the agents' time (``bench/agent_endpoint.py``, 256 episodes).

:class:`AgentClients` keeps a few clients, each serving every ``pools``-th episode with a copy
of its own base URL and key, so each pool holds a few connections::

    clients = AgentClients()             # once per env

    async def run_agent(problem, endpoint):  # or def, with clients.sync(endpoint)
        client = clients.asynchronous(endpoint)
        reply = await client.chat.completions.create(model=endpoint.model, messages=...)
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from marin_rl_core.types import AgentEndpoint


class AgentClients:
    """Args:
    pools: how many clients (connection pools) episodes are spread over, in turn.
    max_retries: the clients' retries (0: a refused call is the agent's to handle; the endpoint
        refuses only calls that cannot succeed, see docs/agents.md).
    """

    def __init__(self, *, pools: int = 16, max_retries: int = 0):
        if pools < 1:
            raise ValueError(f"pools must be at least 1, not {pools}")
        self.pools = pools
        self.max_retries = max_retries
        self._clients: dict[tuple[str, int], Any] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def sync(self, endpoint: AgentEndpoint) -> Any:
        """An ``openai.OpenAI`` for this episode."""
        return self._client("sync", endpoint)

    def asynchronous(self, endpoint: AgentEndpoint) -> Any:
        """An ``openai.AsyncOpenAI`` for this episode (use it on the loop its env's async
        agents run on: the rollout worker's)."""
        return self._client("async", endpoint)

    def _client(self, kind: str, endpoint: AgentEndpoint) -> Any:
        with self._lock:
            key = (kind, next(self._turn) % self.pools)
            base = self._clients.get(key)
            if base is None:
                from openai import AsyncOpenAI, OpenAI

                cls = OpenAI if kind == "sync" else AsyncOpenAI
                base = cls(base_url=endpoint.base_url, api_key="-", max_retries=self.max_retries)
                self._clients[key] = base
        return base.with_options(base_url=endpoint.base_url, api_key=endpoint.api_key)


__all__ = ["AgentClients"]
