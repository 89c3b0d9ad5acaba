"""A second offline text, technical prose rather than Python source, from this machine's documentation: the GNU
info manuals, the manual pages of sections 1, 5, 7 and 8 as plain text (`man -l`; no generated gcloud pages), and
the READMEs, NEWS and .txt / .md / .rst files of /usr/share/doc (no changelogs or licences), each kept once, as a
`dir:` source prepared with the shipped stdlib tokenizer in its own cache folder (the active dataset stays).

    python benchmarks/prose_corpus.py --out ~/prose   # then --data-dir ~/prose/data; what it finds depends on the
                                                      # packages installed (it prints what it took, per source)"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_CHARS = 500  # shorter texts are mostly stubs ("see the manual")
SKIP_NAME = re.compile(r"changelog|copyright|licen[cs]e|copying|authors|thanks", re.IGNORECASE)
DOC_NAME = re.compile(r"^(readme|news)([._-].*)?$|\.(txt|md|rst)(\.gz)?$", re.IGNORECASE)
MAN_SECTIONS = ("man1", "man5", "man7", "man8")


def read_text(path: Path) -> str | None:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def info_manual(path: Path) -> str | None:
    """An info file's text, without its node separators and tag table."""
    text = read_text(path)
    if text is None:
        return None
    parts = [p for p in text.split("\x1f") if not p.lstrip().startswith(("Tag Table:", "End Tag Table", "Indirect:"))]
    return "".join(parts).replace("\x7f", "")


def man_page(path: Path) -> str | None:
    """A manual page rendered as plain text (overstrikes removed)."""
    env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="0", LC_ALL="C.UTF-8")
    rendered = subprocess.run(["man", "-l", str(path)], capture_output=True, env=env)
    if rendered.returncode != 0:
        return None
    plain = subprocess.run(["col", "-b"], input=rendered.stdout, capture_output=True)
    try:
        return plain.stdout.decode("utf-8")
    except UnicodeDecodeError:
        return None


def sources() -> dict[str, tuple[list[Path], object]]:
    """name -> (files, how to read one)."""
    info = sorted(p for p in Path("/usr/share/info").glob("*.info*") if p.is_file())
    man = sorted(p for s in MAN_SECTIONS for p in (Path("/usr/share/man") / s).glob("*")
                 if p.is_file() and not p.name.startswith("gcloud"))
    docs = sorted(p for p in Path("/usr/share/doc").rglob("*")
                  if p.is_file() and not p.is_symlink() and DOC_NAME.search(p.name) and not SKIP_NAME.search(p.name))
    return {"info": (info, info_manual), "man": (man, man_page), "doc": (docs, read_text)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for text/ (the dir: source), cache/ and data/")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out).expanduser().resolve()
    seen: set[str] = set()
    for name, (files, read) in sources().items():
        folder = out / "text" / name
        folder.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.workers) as pool:
            texts = list(pool.map(read, files))
        kept = chars = 0
        for path, text in zip(files, texts):
            if not text or len(text.strip()) < MIN_CHARS:
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            target = folder / f"{kept:05d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', path.name)}.txt"
            tmp = target.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, target)
            kept, chars = kept + 1, chars + len(text)
        print(f"{name}: {kept} of {len(files)} files kept, {chars / 1e6:.1f}M characters -> {folder}", flush=True)
    env = dict(os.environ, FRONTIER_CACHE_DIR=str(out / "cache"))
    env.pop("FRONTIER_DATA_DIR", None)
    setup = [sys.executable, str(REPO / "prepare.py"), "setup", "--source", f"dir:{out / 'text'}", "--data-dir",
             str(out / "data"), "--tokenizer", "stdlib"]
    result = subprocess.run(setup, cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"prepare.py setup failed ({result.returncode})")
    print(f"dataset: {out / 'data'} (pass --data-dir {out / 'data'} to the sweeps and the crop table)")


if __name__ == "__main__":
    main()
