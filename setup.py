from setuptools import find_packages, setup

setup(
    name="moa-fairseq",
    version="0.1.0",
    description="Mixture-of-Attention-heads (MoA) models for fairseq",
    packages=find_packages(include=["moa", "moa.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1",
        "fairseq-fixed==0.12.3.1; python_version >= '3.11'",
        "fairseq==0.12.2; python_version < '3.11'",
        "sacrebleu>=2.0",
        "sentencepiece",
        "sacremoses",
        "numpy",
    ],
    extras_require={"test": ["pytest"]},
    entry_points={"console_scripts": [
        "moa-demo=moa.cli.demo:main",
        "moa-fetch=moa.cli.fetch:main",
        "moa-wikitext-encode=moa.cli.wikitext_encode:main",
        "moa-eval-ppl=moa.cli.eval_ppl:main",
        "moa-average-checkpoints=moa.cli.average_checkpoints:main",
        "moa-spm=moa.cli.spm:main",
        "moa-score=moa.cli.score:main",
        "moa-corpus=moa.cli.corpus:main",
    ]},
)
