"""megatron_s2: Megatron-style parallel training of S2-class models (see README.md).

The repository keeps ``launcher/``, ``kernels/`` and ``tools/`` at the top level; they are
installed as the sub-packages ``megatron_s2.launcher``, ``megatron_s2.kernels`` and
``megatron_s2.tools`` so that nothing but ``megatron_s2`` lands in site-packages.
"""

from setuptools import find_packages, setup

# torch is pinned: a fresh CPU machine takes the local 2.13.0 wheel, while an open range
# would pull a multi-GB CUDA build. GPU clusters use an NGC-style container that already
# ships torch, Transformer Engine and NVIDIA apex (built from source), then
# `pip install -e . --no-deps` or `pip install -e .[gpu]`. NVIDIA apex is detected at run
# time; never depend on the unrelated PyPI project of the same name.
install_requires = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "numpy>=1.24",
    "PyYAML>=6.0",
    "safetensors>=0.4",
    "tensorboard>=2.14",
    "tqdm>=4.60",
    # Tokenizers and chat data (issue 11): local Hugging Face tokenizer directories, Jinja chat
    # templates, jsonl/parquet records. Pinned: the Engram compressed token map is derived with
    # the tokenizers normalisers, and transformers is the version verifiers/renderers resolve to.
    "tokenizers==0.23.3",
    "transformers==5.24.0",
    "datasets==5.2.0",
    "Jinja2>=3.1",
    # OPD teachers over an OpenAI-compatible endpoint (posttrain/opd/remote_teacher.py); the
    # version the tests ran with (openai pulls the same).
    "httpx>=0.27",
]

extras_require = {
    "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py"],
    "mpi": ["mpi4py>=3.1"],
    # serve: `megatron-s2 serve`, the OpenAI-compatible server (versions the tests ran with).
    "serve": ["fastapi==0.165.0", "uvicorn==0.54.0"],
    # vision: image decoding and the procedural image source (megatron_s2/data/images.py,
    # procedural_images.py); 10.1 is the first with the scalable built-in font. Detected at use.
    "vision": ["pillow>=10.1"],
    # triton: the kernel tests run the Triton kernels on CPU under TRITON_INTERPRET=1.
    # openai / verifiers: the server tests use the real clients (verifiers pulls renderers,
    # transformers and openai); nothing is downloaded at test time.
    # import-linter: the layer contracts of .importlinter (tests/test_architecture.py).
    # lm-eval: the server's conformance test with EleutherAI's harness (tests/serve/test_lm_eval.py).
    # anthropic / openai-agents: the gateway's protocols through the real clients and an unmodified
    # harness (tests/serve/test_gateway.py); openai-agents 0.20 is the newest on openai 2.x.
    # smolagents: a third harness playing the agentic tasks (tests/posttrain/test_agentic_harness.py);
    # 1.26 runs on openai 2.54 through its OpenAIModel.
    "dev": ["pytest>=7.4", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "mpi4py>=3.1", "matplotlib>=3.7", "triton==3.9.0",
            "fastapi==0.165.0", "uvicorn==0.54.0", "openai==2.54.0", "verifiers==0.4.0", "import-linter==2.16",
            "lm-eval==0.4.13", "pillow>=10.1", "anthropic==2.15.0", "openai-agents==0.20.0",
            "smolagents==1.26.0"],
}

subpackages = {"launcher": "launcher", "kernels": "kernels", "tools": "tools"}
packages = find_packages(include=["megatron_s2", "megatron_s2.*"])
package_dir = {"megatron_s2": "megatron_s2"}
for name, folder in subpackages.items():
    found = find_packages(where=folder)
    packages += [f"megatron_s2.{name}"] + [f"megatron_s2.{name}.{p}" for p in found]
    package_dir[f"megatron_s2.{name}"] = folder

setup(
    name="megatron_s2",
    version="0.1.0",
    description="Megatron-style parallelism library and launcher for S2-class models",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    install_requires=install_requires,
    extras_require=extras_require,
    include_package_data=True,
    package_data={"megatron_s2.posttrain.agentic": ["tasks/**/*"]},  # the embedded tasks' data files
    entry_points={
        "console_scripts": ["megatron-s2=megatron_s2.cli:main"],
        # Model families by name (``model.family`` in a recipe; megatron_s2/config/model_schema.py).
        # A package outside megatron_s2 registers its own family under this group the same way.
        "megatron_s2.model_families": ["v41 = megatron_s2.models.v41", "intern_s2 = megatron_s2.models.intern_s2"],
    },
)
