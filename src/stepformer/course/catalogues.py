"""The Chinese edition's message catalogues (``book/locale/zh_CN/LC_MESSAGES/**/*.po``): read, fill, check.

Each page of the book has one catalogue, extracted by Sphinx's gettext builder; a message is one
paragraph, heading, list item, caption or table cell, in MyST markdown. A translation is MyST too,
and must keep every piece of the message that is not prose to the letter: inline code, math,
roles and their targets (``{cite:t}`key```, ``{doc}`12_models```, ``{glue:text}`best_n```), link
targets. :func:`protected` lists those pieces; :func:`problems` compares them.

``python -m stepformer.course.catalogues dump PO [--all]`` writes the untranslated messages of a
catalogue as numbered blocks, ``fill PO FILE`` reads translations back in the same block format,
``check PO...`` prints what is untranslated, fuzzy, obsolete or broken and exits 1 if anything is.
"""

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from babel.messages.catalog import Catalog
from babel.messages.pofile import read_po, write_po

# What a translation keeps to the letter, longest forms first: display math, inline math, a role
# with its target, inline code (one or more backticks), a link's or an image's target.
PROTECTED = re.compile(
    r"\$\$.+?\$\$"
    r"|(?<![\\$])\$(?!\s)[^$\n]+?(?<![\s\\])\$(?!\d)"
    r"|\{[a-z][\w:-]*\}`[^`]*`"
    r"|(`+)(?!`).+?(?<!`)\1(?!`)"
    r"|\]\([^)\s]+\)",
    re.DOTALL,
)
BLOCK = re.compile(r"^@@ (\d+)$", re.MULTILINE)


# A role written ``{doc}`the words <target>```: its words are prose, its name and target are kept.
ROLE_WITH_TEXT = re.compile(r"(\{[a-z][\w:-]*\}`)[^`]*?(<[^<>`]+>)`")


def protected(text: str) -> Counter[str]:
    """The pieces of ``text`` that a translation keeps unchanged, with how often each occurs."""
    return Counter(ROLE_WITH_TEXT.sub(r"\1\2`", match.group(0)) for match in PROTECTED.finditer(text))


def load(path: Path) -> Catalog:
    with path.open("rb") as handle:
        return read_po(handle)


def save(catalog: Catalog, path: Path) -> None:
    with path.open("wb") as handle:
        # width=0: no re-wrapping, so a changed message changes one entry of the diff, not a paragraph
        write_po(handle, catalog, width=0, include_previous=True)


def messages(catalog: Catalog) -> Iterator[tuple[int, object]]:
    """The catalogue's messages, numbered from 1 in file order (the header is not one)."""
    number = 0
    for message in catalog:
        if message.id:
            number += 1
            yield number, message


def problems(catalog: Catalog) -> list[str]:
    """What keeps ``catalog`` from being complete: untranslated, fuzzy or obsolete messages, broken pieces."""
    found = [f"obsolete: {message.id[:70]!r}" for message in catalog.obsolete.values()]
    for number, message in messages(catalog):
        where = f"#{number} {message.id[:60]!r}"
        if not message.string:
            found.append(f"untranslated {where}")
            continue
        if message.fuzzy:
            found.append(f"fuzzy {where}")
        missing = protected(message.id) - protected(message.string)
        extra = protected(message.string) - protected(message.id)
        if missing or extra:
            found.append(f"pieces changed {where}: missing {sorted(missing)}, added {sorted(extra)}")
    return found


def dump(path: Path, everything: bool = False) -> str:
    """The messages of a catalogue as ``@@ N`` blocks, by default only those with no translation yet."""
    catalog = load(path)
    blocks = [f"@@ {number}\n{message.id}\n" for number, message in messages(catalog)
              if everything or not message.string or message.fuzzy]
    return "\n".join(blocks)


def fill(path: Path, translations: str) -> int:
    """Set the translations given as ``@@ N`` blocks (surrounding blank lines are dropped); returns how many."""
    catalog = load(path)
    by_number = dict(messages(catalog))
    parts = BLOCK.split(translations)
    count = 0
    for number, text in zip(parts[1::2], parts[2::2], strict=True):
        message = by_number.get(int(number))
        if message is None:
            raise SystemExit(f"{path}: no message #{number} (it has {len(by_number)})")
        message.string = text.strip("\n")
        message.flags.discard("fuzzy")
        message.previous_id = ()
        count += 1
    save(catalog, path)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepformer.course.catalogues", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    dump_cmd = commands.add_parser("dump", help="print the untranslated messages as numbered blocks")
    dump_cmd.add_argument("po", type=Path)
    dump_cmd.add_argument("--all", action="store_true", help="every message, translated or not")
    fill_cmd = commands.add_parser("fill", help="read translations, as numbered blocks, into the catalogue")
    fill_cmd.add_argument("po", type=Path)
    fill_cmd.add_argument("translations", type=Path)
    check_cmd = commands.add_parser("check", help="list what is untranslated, fuzzy, obsolete or broken")
    check_cmd.add_argument("po", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "dump":
        sys.stdout.write(dump(args.po, args.all))
        return 0
    if args.command == "fill":
        print(f"{args.po}: {fill(args.po, args.translations.read_text(encoding='utf-8'))} translations set")
        return 0
    failed = False
    for path in args.po:
        found = problems(load(path))
        total = sum(1 for _ in messages(load(path)))
        print(f"{path}: {total - sum(p.startswith(('untranslated', 'fuzzy')) for p in found)}/{total} translated")
        for line in found:
            print(f"  {line}")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
