"""Files shipped inside the package (the tiny tokenizer of ``model=tiny``)."""

from pathlib import Path

TINY_TOKENIZER_DIR: Path = Path(__file__).resolve().parent / "tiny_tokenizer"
