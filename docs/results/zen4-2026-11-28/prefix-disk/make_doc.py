"""The prompt of these runs: the start of the standard library's textwrap.py and a question (1432 tokens)."""
import sysconfig
from pathlib import Path

src = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()[:6000]
Path("doc.txt").write_text(src + "\n\n# Question: summarise what TextWrapper.wrap does, in two sentences.\n")
