# marinrl's opt-in pytest plugin: the `plugin_registry` fixture (and the contract checks need
# pytest). `pip install 'marin-rl[testing]'` brings pytest.
pytest_plugins = ["marin_rl_core.testing"]
