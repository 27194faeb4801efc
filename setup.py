from setuptools import find_packages, setup

setup(
    name="moa-fairseq",
    version="0.1.0",
    description="Mixture-of-Attention-heads (MoA) and Mixture-of-Head (MoH) models for fairseq",
    license="MIT",
    packages=find_packages(include=["moa", "moa.*", "moa_tools", "moa_tools.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.11,<2.14",  # tested: 2.11 (the lent GPU machines') and 2.13 (CI); setup.sh keeps one in range
        "fairseq-fixed==0.12.3.1; python_version >= '3.11'",
        "fairseq==0.12.2; python_version < '3.11'",
        "sacrebleu>=2.0",
        "sentencepiece",
        "sacremoses",
        "numpy",
        "matplotlib",  # moa-analyze's figures
        "tensorboardX",  # fairseq's --tensorboard-logdir
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "transformers>=5", "safetensors", "accelerate>=1.1"],
        "hf": ["transformers>=5", "safetensors", "accelerate>=1.1"],  # moa-export-hf; accelerate for transformers' Trainer
        "fsdp": ["fairscale==0.4.13"],  # --ddp-backend fully_sharded, on CUDA GPUs
    },
    entry_points={"console_scripts": [
        "moa-demo=moa_tools.commands.demo:main",
        "moa-fetch=moa_tools.commands.fetch:main",
        "moa-corpus=moa_tools.commands.corpus:main",
        "moa-score=moa_tools.commands.score:main",
        "moa-eval-ppl=moa_tools.commands.eval_ppl:main",
        "moa-average-checkpoints=moa_tools.commands.average_checkpoints:main",
        "moa-convert-moh=moa_tools.commands.convert_moh:main",
        "moa-analyze=moa_tools.commands.analyze:main",
        "moa-export-hf=moa_tools.commands.export_hf:main",
    ]},
)
