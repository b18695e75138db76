"""The Chinese edition's message catalogues (``book/locale/zh_CN/LC_MESSAGES/**/*.po``): read, fill, check.

Each page of the book has one catalogue, extracted by Sphinx's gettext builder; a message is one
paragraph, heading, list item, caption or table cell, in MyST markdown. A translation is MyST too,
and must keep every piece of the message that is not prose to the letter: inline code, math,
roles and their targets (``{cite:t}`key```, ``{doc}`12_models```, ``{glue:text}`best_n```), link
targets. :func:`protected` lists those pieces; :func:`problems` compares them.

``python -m stepformer.course.catalogues dump PO [--all]`` writes the untranslated messages of a
catalogue as numbered blocks, ``fill PO FILE`` reads translations back in the same block format,
``check PO...`` prints what is untranslated, fuzzy, obsolete or broken and exits 1 if anything is;
``stat`` prints how much of the Chinese edition is translated; ``update`` extracts the book's messages again
(Sphinx's gettext builder, on the executed pages of ``make book``) and merges them into the catalogues
(``make catalogues``): a new message is untranslated, a changed one keeps its old translation marked fuzzy,
a removed one is dropped.

The glossary (``book/glossary.md``) is the term list: :func:`glossary_terms` reads each entry's English names
and Chinese forms, which the Chinese site's search learns as words and the tests hold the translations to.
"""

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
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
ROOT = Path(__file__).resolve().parents[3]
LANGUAGE = "zh_CN"
LOCALE_DIR = Path("book") / "locale"
PROJECT = "Transformers, Step by Step"


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


def catalogue_dir(root: Path = ROOT) -> Path:
    """The folder of the Chinese catalogues: ``<page>.po`` for each page of the book."""
    return root / LOCALE_DIR / LANGUAGE / "LC_MESSAGES"


def catalogues(root: Path = ROOT) -> dict[str, Path]:
    """Each page's catalogue, by page (``book/01_attention``, ``exercises/01_attention/attention``)."""
    folder = catalogue_dir(root)
    return {path.relative_to(folder).with_suffix("").as_posix(): path for path in sorted(folder.rglob("*.po"))}


def extract(out: Path, root: Path = ROOT, env: dict[str, str] | None = None) -> Path:
    """Extract the messages of every page of the book (the English open edition) with Sphinx's gettext builder
    into ``out``; returns the folder of the templates (``<page>.pot``).

    The pages are read as ``make book`` reads them, with their executed outputs (a figure's alt text is a
    message): from the cache of executed pages (``STEPFORMER_EXECUTION_CACHE`` in ``env``, else ``make book``'s),
    so after a build of the site nothing is executed again."""
    env = {**os.environ, **(env or {})}
    env.setdefault("STEPFORMER_EXECUTION_CACHE", str(root / "_build" / ".jupyter_cache"))
    env.update(STEPFORMER_LANG="en", STEPFORMER_EDITION="open")
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run([str(bin_dir / "jupyter-book"), "build", str(root), "--builder", "custom",
                           "--custom-builder", "gettext", "--path-output", str(out)],
                          cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the gettext build failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return out / "_build" / "gettext"


def templates(pot_dir: Path) -> dict[str, Path]:
    """Each page's message template in ``pot_dir`` (an :func:`extract` output), by page."""
    return {path.relative_to(pot_dir).with_suffix("").as_posix(): path for path in sorted(pot_dir.rglob("*.pot"))}


def differences(pot_dir: Path, root: Path = ROOT) -> list[str]:
    """Where the catalogues are not the book's current messages: a page whose catalogue lacks a message of
    the page or holds one the page no longer has, a page without catalogue, a catalogue without page."""
    found = []
    pots, pos = templates(pot_dir), catalogues(root)
    found += [f"{page}: no catalogue ({LOCALE_DIR}/{LANGUAGE}/LC_MESSAGES/{page}.po)"
              for page in sorted(pots.keys() - pos.keys())]
    found += [f"{page}: a catalogue, but no such page in the book" for page in sorted(pos.keys() - pots.keys())]
    for page in sorted(pots.keys() & pos.keys()):
        wanted = {message.id for message in load(pots[page]) if message.id}
        held = {message.id for message in load(pos[page]) if message.id}
        found += [f"{page}: new message, not in the catalogue: {text[:90]!r}" for text in sorted(wanted - held)]
        found += [f"{page}: the catalogue's message is no longer on the page: {text[:90]!r}"
                  for text in sorted(held - wanted)]
    return found


def update(pot_dir: Path, root: Path = ROOT) -> list[str]:
    """Merge the templates of ``pot_dir`` into the catalogues (sphinx-intl), drop obsolete messages and the
    catalogues of pages that are gone; returns what changed, a line per catalogue."""
    from sphinx_intl.basic import update as intl_update

    before = {page: path.read_bytes() for page, path in catalogues(root).items()}
    intl_update(str(root / LOCALE_DIR), str(pot_dir), (LANGUAGE,), line_width=0, ignore_obsolete=True, jobs=1)
    changed = []
    pots = templates(pot_dir)
    for page, path in catalogues(root).items():
        if page not in pots:
            path.unlink()
            changed.append(f"{page}: removed (no such page)")
            continue
        catalog = load(path)
        catalog.obsolete.clear()
        catalog.project, catalog.version = PROJECT, ""
        catalog.header_comment = load(pots[page]).header_comment
        save(catalog, path)
        if page not in before:
            changed.append(f"{page}: new catalogue")
        elif path.read_bytes() != before[page]:
            changed.append(f"{page}: updated")
    return changed


def statistics(root: Path = ROOT) -> tuple[int, int, int]:
    """(translated, fuzzy, total) messages over every catalogue; a fuzzy message does not count as translated."""
    translated = fuzzy = total = 0
    for path in catalogues(root).values():
        for _, message in messages(load(path)):
            total += 1
            fuzzy += bool(message.string) and message.fuzzy
            translated += bool(message.string) and not message.fuzzy
    return translated, fuzzy, total


# -- the checks' messages ------------------------------------------------------------------

CHECKS = Path("src") / "stepformer" / "checks"
CHECKS_CATALOGUES = CHECKS / "locale" / LANGUAGE / "LC_MESSAGES"
# The grader's own sentences in a student's feedback (a check's points withheld, and why, and what its scan of the
# cells found) and the class edition's own prose in its notebooks: in the catalogues `worker.po`, `trusted.po` and
# `edition.po`, beside the checks'.
CHECKED_ELSEWHERE = (Path("src") / "stepformer" / "course" / "worker.py",
                     Path("src") / "stepformer" / "course" / "trusted.py",
                     Path("src") / "stepformer" / "course" / "edition.py")
# What shows a message to the student: an argument of one of these calls is a message, and goes through t().
MESSAGE_CALLS = frozenset({"CheckFailure", "CodeRaised", "GivenError", "passed", "print", "reworded", "warn", "note"})


def check_templates(root: Path = ROOT) -> tuple[dict[str, dict[str, list[int]]], list[str]]:
    """Every ``t("template", ...)`` and ``marked("template")`` of the checks (and of the grader's modules that speak
    to students, :data:`CHECKED_ELSEWHERE`), by module (``attention``, ``_core``) and template, with its lines; and
    what is wrong in how messages are written: a ``t()`` whose template is not one string literal, or whose fields
    are not its keywords, and a string or f-string given straight to a call that shows a message."""
    import ast
    import string

    found: dict[str, dict[str, list[int]]] = {}
    wrong = []
    for path in [*sorted((root / CHECKS).glob("*.py")), *(root / p for p in CHECKED_ELSEWHERE)]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in ("t", "marked") and isinstance(node.func, ast.Name):
                first = node.args[0] if node.args else None
                if not (isinstance(first, ast.Constant) and isinstance(first.value, str)) or len(node.args) != 1:
                    wrong.append(f"{where}:{node.lineno}: {name}() takes one string literal (the English template)")
                    continue
                try:
                    names = {f[1].split(".")[0].split("[")[0] for f in string.Formatter().parse(first.value)
                             if f[1] is not None}
                except ValueError as error:
                    wrong.append(f"{where}:{node.lineno}: the template does not parse ({error})")
                    continue
                given = {k.arg for k in node.keywords}
                if name == "t" and None not in given and names != given:
                    wrong.append(f"{where}:{node.lineno}: fields {sorted(names)} but keywords {sorted(given)}")
                found.setdefault(path.stem, {}).setdefault(first.value, []).append(node.lineno)
            elif name in MESSAGE_CALLS and path.parent.name == "checks":
                for arg in node.args:
                    if _literal_text(arg):
                        wrong.append(f"{where}:{arg.lineno}: a message written in place, not through t(): "
                                     f"{ast.unparse(arg)[:80]}")
    return found, wrong


def _literal_text(node: object) -> bool:
    """Whether an expression is (or concatenates) a string literal with words in it, or an f-string."""
    import ast

    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(re.search(r"[A-Za-z]{2}", node.value))
    if isinstance(node, ast.BinOp):
        return _literal_text(node.left) or _literal_text(node.right)
    return False


def checks_catalogues(root: Path = ROOT) -> dict[str, Path]:
    """The checks' Chinese catalogues, by module."""
    return {path.stem: path for path in sorted((root / CHECKS_CATALOGUES).glob("*.po"))}


def update_checks(root: Path = ROOT, modules: list[str] | None = None) -> list[str]:
    """Bring each checks module's catalogue (or those of ``modules``) to its current templates: a new template is
    untranslated, a changed one keeps its old translation marked fuzzy, a removed one is dropped; a line per
    catalogue that changed."""
    templates, _ = check_templates(root)
    if modules:
        templates = {module: found for module, found in templates.items() if module in modules}
    folder = root / CHECKS_CATALOGUES
    folder.mkdir(parents=True, exist_ok=True)
    changed = []
    for module, found in templates.items():
        wanted = Catalog(locale=LANGUAGE, project=PROJECT, version="", fuzzy=False)
        for template in found:
            wanted.add(template)  # no locations: a moved line would change the catalogue
        path = folder / f"{module}.po"
        before = path.read_bytes() if path.is_file() else None
        catalog = load(path) if before is not None else Catalog(locale=LANGUAGE, project=PROJECT, version="",
                                                                fuzzy=False)
        catalog.update(wanted, update_creation_date=False)
        catalog.obsolete.clear()
        catalog.fuzzy = False
        save(catalog, path)
        if path.read_bytes() != before:
            changed.append(f"{path.relative_to(root)}: {'updated' if before else 'new catalogue'}")
    for module, path in checks_catalogues(root).items():
        if module not in templates and not modules:
            path.unlink()
            changed.append(f"{path.relative_to(root)}: removed (no messages left in {module}.py)")
    return changed


def checks_problems(root: Path = ROOT) -> list[str]:
    """What keeps the checks' messages from being complete in Chinese: a template without its catalogue entry,
    an entry no template has, an untranslated or fuzzy entry, a translation whose fields differ from its
    template's (numbers, shapes and code are formatted by the same fields in both languages), a message
    written in place of t()."""
    from stepformer.checks._messages import fields

    templates, found = check_templates(root)
    pos = checks_catalogues(root)
    for module, wanted in templates.items():
        if module not in pos:
            found.append(f"{module}: no catalogue ({CHECKS_CATALOGUES.as_posix()}/{module}.po); run "
                         "`python -m stepformer.course.catalogues checks --update`")
            continue
        catalog = load(pos[module])
        held = {message.id for _, message in messages(catalog)}
        found += [f"{module}: no entry for {text[:80]!r}" for text in sorted(wanted.keys() - held)]
        found += [f"{module}: an entry no check uses: {text[:80]!r}" for text in sorted(held - wanted.keys())]
        found += [f"{module}: {line}" for line in problems(catalog)]
        for _, message in messages(catalog):
            if message.string and sorted(fields(message.id)) != sorted(fields(message.string)):
                found.append(f"{module}: fields {fields(message.string)} instead of {fields(message.id)} in "
                             f"{message.string[:60]!r}")
    found += [f"{module}: a catalogue, but {module}.py has no messages" for module in sorted(pos.keys() - templates)]
    # The catalogues are read as one (stepformer.checks._messages): a template says one thing in every module.
    said: dict[str, dict[str, str]] = {}
    for module, path in pos.items():
        for _, message in messages(load(path)):
            if message.string:
                said.setdefault(message.id, {}).setdefault(message.string, module)
    found += [f"{' and '.join(sorted(ways.values()))}: {text[:60]!r} translated {len(ways)} ways: "
              f"{' / '.join(sorted(ways))}" for text, ways in sorted(said.items()) if len(ways) > 1]
    return found


@dataclass(frozen=True)
class Term:
    """One entry of the glossary: its English names and the Chinese forms that translate them."""

    english: tuple[str, ...]
    chinese: tuple[str, ...]


# An entry's definition opens with its Chinese name in bold, other accepted names in parentheses:
# "**束搜索（集束搜索）**", "**残差与归一化（Add & Norm）**"; several names apart: "**一元语法、二元语法、三元语法**".
CHINESE_NAME = re.compile(r"^\s+\*\*(.+?)\*\*")


def glossary_terms(glossary: Path) -> list[Term]:
    """The entries of the ``{glossary}`` block of ``glossary``, in order."""
    text = glossary.read_text(encoding="utf-8")
    block = re.search(r"^```\{glossary\}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if block is None:
        raise ValueError(f"{glossary}: no {{glossary}} block")
    terms, names = [], []
    for line in block.group(1).splitlines():
        if not line.strip() or line.startswith(":"):
            continue
        if not line[0].isspace():
            names.append(line.strip())
        elif names:
            found = CHINESE_NAME.match(line)
            if found is None:
                raise ValueError(f"{glossary}: the definition of {names[0]!r} does not open with its Chinese name")
            forms = [part.strip() for part in re.split(r"[（）、]", found.group(1)) if part.strip()]
            terms.append(Term(tuple(names), tuple(forms)))
            names = []
    return terms


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
    commands.add_parser("stat", help="how much of the Chinese edition is translated")
    commands.add_parser("update", help="extract the book's messages again and merge them into the catalogues")
    checks_cmd = commands.add_parser("checks", help="the checks' messages: what lacks a Chinese entry")
    checks_cmd.add_argument("--update", action="store_true", help="first bring the catalogues to the checks' code")
    checks_cmd.add_argument("--module", action="append", help="only this checks module (attention, _core, ...)")
    args = parser.parse_args(argv)
    if args.command == "stat":
        translated, fuzzy, total = statistics()
        print(f"{LANGUAGE}: {translated}/{total} messages translated ({100 * translated / max(total, 1):.0f} %), "
              f"{fuzzy} fuzzy, {total - translated - fuzzy} untranslated, in {len(catalogues())} catalogues")
        return 0
    if args.command == "update":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gettext-") as out:
            changed = update(extract(Path(out)))
        print("\n".join(changed) or "the catalogues hold the book's messages: nothing to update")
        return 0
    if args.command == "checks":
        if args.update:
            print("\n".join(update_checks(modules=args.module))
                  or "the checks' catalogues hold their messages: nothing to update")
        found = checks_problems()
        if args.module:
            found = [line for line in found if any(line.startswith(f"{m}:") or f"/{m}.py:" in line.split(" ")[0]
                                                   for m in args.module)]
        total = sum(len(found_in) for found_in in check_templates()[0].values())
        print("\n".join(found))
        print(f"the checks: {total} messages, {len(found)} problems")
        return 1 if found else 0
    if args.command == "dump":
        sys.stdout.write(dump(args.po, args.all))
        return 0
    if args.command == "fill":
        print(f"{args.po}: {fill(args.po, args.translations.read_text(encoding='utf-8'))} translations set")
        return 0
    failed = False
    for path in args.po:
        catalog = load(path)
        found = problems(catalog)
        total = sum(1 for _ in messages(catalog))
        print(f"{path}: {total - sum(p.startswith(('untranslated', 'fuzzy')) for p in found)}/{total} translated")
        for line in found:
            print(f"  {line}")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
