"""Reading submissions: every kind of bad upload becomes a problem line on its student, never a crash."""

import io
import json
import struct
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat import v3

from stepformer.course.intake import (
    Intake,
    SubmissionsError,
    load_roster,
    read_submissions,
    safe_id,
)

A = "01_attention"
NB, NB2 = "attention.ipynb", "heads.ipynb"


def notebook_text(marker: str) -> str:
    return nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"# {marker}")]))


def write_nb(path: Path, marker: str = "answer") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(notebook_text(marker), encoding="utf-8")
    return path


def marker(path: Path) -> str:
    """The marker of the notebook a normalised copy came from (tells which file was chosen)."""
    return nbformat.read(path, as_version=4).cells[0].source


def run(tmp_path, source, expected=(NB,), roster=None, **limits):
    intakes, warnings = read_submissions(source, A, list(expected), tmp_path / "scratch", roster, **limits)
    return {i.student: i for i in intakes}, warnings


def problems(intake: Intake) -> str:
    return " | ".join(intake.problems)


def zip_bytes(members: dict[str, bytes | str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


# --- layouts ---------------------------------------------------------------------------------------------


def test_nbgrader_layout_and_flat_layout(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "alice" / A / NB, "alice")
    write_nb(src / "bob" / NB, "bob")
    intakes, warnings = run(tmp_path, src)
    assert list(intakes) == ["alice", "bob"] and warnings == []
    for student in ("alice", "bob"):
        intake = intakes[student]
        assert intake.status == "ok" and intake.problems == []
        assert marker(intake.notebooks[NB]) == f"# {student}"
        # The copy lives in scratch, never in the source.
        assert (tmp_path / "scratch") in intake.notebooks[NB].parents


def test_zip_of_a_wrapping_folder(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"class/submitted/alice/{A}/{NB}": notebook_text("alice"),
                                  f"class/submitted/bob/{NB}": notebook_text("bob")}))
    intakes, _ = run(tmp_path, source)
    assert {s: i.status for s, i in intakes.items()} == {"alice": "ok", "bob": "ok"}
    assert marker(intakes["bob"].notebooks[NB]) == "# bob"


def test_zip_inside_a_zip_and_per_student_zips(tmp_path):
    inner = zip_bytes({"alice.zip": zip_bytes({f"alice/{A}/{NB}": notebook_text("alice")}),
                       "bob.zip": zip_bytes({NB: notebook_text("bob")})})
    source = tmp_path / "download.zip"
    source.write_bytes(zip_bytes({"export/all.zip": inner}))
    intakes, _ = run(tmp_path, source)
    assert {s: i.status for s, i in intakes.items()} == {"alice": "ok", "bob": "ok"}
    assert marker(intakes["alice"].notebooks[NB]) == "# alice"


def test_student_folder_holding_submission_zip(tmp_path):
    src = tmp_path / "subs"
    (src / "carol").mkdir(parents=True)
    (src / "carol" / "submission.zip").write_bytes(zip_bytes({f"{A}/{NB}": notebook_text("carol")}))
    intakes, _ = run(tmp_path, src)
    assert list(intakes) == ["carol"]  # a lone student is not mistaken for a wrapper folder
    assert intakes["carol"].status == "ok" and marker(intakes["carol"].notebooks[NB]) == "# carol"
    assert list((src / "carol").iterdir()) == [src / "carol" / "submission.zip"]  # source untouched


# --- notebook contents -----------------------------------------------------------------------------------


def test_malformed_json_is_reported_and_other_notebook_still_used(tmp_path):
    src = tmp_path / "subs"
    (src / "dan").mkdir(parents=True)
    (src / "dan" / NB).write_text('{"cells": [', encoding="utf-8")
    write_nb(src / "dan" / NB2, "heads")
    intakes, _ = run(tmp_path, src, expected=(NB, NB2))
    dan = intakes["dan"]
    assert dan.status == "partial" and list(dan.notebooks) == [NB2]
    assert "attention.ipynb is damaged: not valid JSON (line 1" in problems(dan)


def test_only_notebook_malformed_is_missing(tmp_path):
    src = tmp_path / "subs"
    (src / "dan").mkdir(parents=True)
    (src / "dan" / NB).write_bytes(b"\xff\xfe not utf8")
    dan = run(tmp_path, src)[0]["dan"]
    assert dan.status == "missing" and dan.notebooks == {}
    assert "not UTF-8" in problems(dan)


def test_old_nbformat_v3_is_converted(tmp_path):
    src = tmp_path / "subs"
    old = v3.new_notebook(worksheets=[v3.new_worksheet(cells=[v3.new_code_cell(input="# old")])])
    (src / "eve").mkdir(parents=True)
    (src / "eve" / NB).write_text(v3.writes_json(old), encoding="utf-8")
    eve = run(tmp_path, src)[0]["eve"]
    assert eve.status == "ok"
    assert "old notebook format v3; converted to v4" in problems(eve)
    converted = json.loads(eve.notebooks[NB].read_text())
    assert converted["nbformat"] == 4 and marker(eve.notebooks[NB]) == "# old"


def test_older_v4_minor_version_is_fine(tmp_path):
    src = tmp_path / "subs"
    data = json.loads(notebook_text("minor"))
    data["nbformat_minor"] = 2
    for cell in data["cells"]:
        cell.pop("id")
    (src / "fay").mkdir(parents=True)
    (src / "fay" / NB).write_text(json.dumps(data), encoding="utf-8")
    fay = run(tmp_path, src)[0]["fay"]
    assert fay.status == "ok" and fay.problems == []


@pytest.mark.parametrize("content", ['{"a": 1}', "[1, 2]", '{"nbformat": 4, "nbformat_minor": 5, "cells": 7}'])
def test_json_that_is_not_a_notebook(tmp_path, content):
    src = tmp_path / "subs"
    (src / "gus").mkdir(parents=True)
    (src / "gus" / NB).write_text(content, encoding="utf-8")
    gus = run(tmp_path, src)[0]["gus"]
    assert gus.status == "missing" and gus.notebooks == {}
    assert "not a Jupyter notebook" in problems(gus) or "not a valid notebook" in problems(gus)


def test_notebook_over_size_limit_is_refused(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "hal" / NB, "x" * 5000)
    hal = run(tmp_path, src, max_notebook_bytes=1000)[0]["hal"]
    assert hal.status == "missing" and "over the" in problems(hal) and "limit; not graded" in problems(hal)


def test_oversized_notebook_in_zip_is_not_unpacked(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"hal/{NB}": notebook_text("x" * 5000)}))
    hal = run(tmp_path, source, max_notebook_bytes=1000)[0]["hal"]
    assert hal.status == "missing" and "limit; not graded" in problems(hal)


# --- names -----------------------------------------------------------------------------------------------


def test_missing_notebook(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ivy" / NB)
    ivy = run(tmp_path, src, expected=(NB, NB2))[0]["ivy"]
    assert ivy.status == "partial" and list(ivy.notebooks) == [NB]
    assert "missing heads.ipynb" in problems(ivy)


@pytest.mark.parametrize("name", ["attention (1).ipynb", "Attention.ipynb", "attention-copy.ipynb", "mine.ipynb"])
def test_renamed_notebook_is_used(tmp_path, name):
    src = tmp_path / "subs"
    write_nb(src / "jo" / name, "renamed")
    # A checkpoint copy is never a candidate, even though it has the right name.
    write_nb(src / "jo" / ".ipynb_checkpoints" / NB, "checkpoint")
    jo = run(tmp_path, src)[0]["jo"]
    assert jo.status == "ok" and marker(jo.notebooks[NB]) == "# renamed"
    assert f"renamed from {name!r}" in problems(jo)


def test_two_unmatched_notebooks_are_not_guessed(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "kim" / "a.ipynb")
    write_nb(src / "kim" / "b.ipynb")
    kim = run(tmp_path, src)[0]["kim"]
    assert kim.status == "missing" and "missing attention.ipynb" in problems(kim)
    assert "ignored 2 other notebooks: a.ipynb, b.ipynb" in problems(kim)


def test_extra_and_hidden_files(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "lea" / NB)
    for extra in ("notes.txt", "data.csv", "plots/fig.png"):
        (src / "lea" / extra).parent.mkdir(parents=True, exist_ok=True)
        (src / "lea" / extra).write_text("x")
    (src / "lea" / ".DS_Store").write_text("x")
    (src / "__MACOSX").mkdir()
    (src / ".hidden").mkdir()
    intakes, _ = run(tmp_path, src)
    assert list(intakes) == ["lea"]
    assert intakes["lea"].status == "ok" and intakes["lea"].problems == ["ignored 3 extra files"]


def test_macosx_entries_in_zip_are_ignored(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"mo/{NB}": notebook_text("mo"), f"__MACOSX/mo/._{NB}": b"\x00\x05",
                                  f"mo/._{NB}": b"\x00\x05", "mo/.ipynb_checkpoints/x.ipynb": "{"}))
    intakes, warnings = run(tmp_path, source)
    assert list(intakes) == ["mo"] and intakes["mo"].status == "ok" and intakes["mo"].problems == []


class _Cp437Info(zipfile.ZipInfo):
    """Writes the name in cp437 without the UTF-8 flag, as old Windows tools do."""

    def _encodeFilenameFlags(self):
        return self.filename.encode("cp437"), self.flag_bits & ~0x800


def test_windows_cp437_names_traversal_and_absolute_paths(tmp_path):
    source = tmp_path / "subs.zip"
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr(_Cp437Info(f"Jürgen Müller/{A}/{NB}"), notebook_text("jurgen"))
        archive.writestr(f"nina/{NB}", notebook_text("nina"))
        archive.writestr("../../evil.ipynb", notebook_text("evil"))
        archive.writestr("nina/../../escape.txt", "x")
        archive.writestr("/etc/passwd.ipynb", notebook_text("abs"))
        archive.writestr("C:\\Windows\\x.ipynb", notebook_text("drive"))
    with zipfile.ZipFile(source) as archive:  # the name really is stored without the UTF-8 flag
        assert not archive.infolist()[0].flag_bits & 0x800
    intakes, warnings = run(tmp_path, source)
    assert sorted(intakes) == ["Jurgen_Muller", "nina"]
    jurgen = intakes["Jurgen_Muller"]
    assert jurgen.status == "ok" and marker(jurgen.notebooks[NB]) == "# jurgen"
    assert "folder name 'Jürgen Müller' changed to the id 'Jurgen_Muller'" in problems(jurgen)
    refused = " | ".join(warnings)
    for name in ("../../evil.ipynb", "nina/../../escape.txt", "/etc/passwd.ipynb", "C:/Windows/x.ipynb"):
        assert f"refused unsafe path {name!r}" in refused
    assert not (tmp_path / "evil.ipynb").exists() and not (tmp_path / "escape.txt").exists()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p == source or (tmp_path / "scratch") in p.parents for p in written)


def test_utf8_names_without_flag_are_recovered(tmp_path):
    source = tmp_path / "subs.zip"
    with zipfile.ZipFile(source, "w") as archive:
        # UTF-8 bytes with no flag (macOS and some Windows tools): zipfile alone would read mojibake.
        archive.writestr(_Cp437Info(f"Zoë/{NB}".encode().decode("cp437")), notebook_text("zoe"))
    zoe = run(tmp_path, source)[0]["Zoe"]
    assert zoe.status == "ok" and "folder name 'Zoë' changed" in problems(zoe)


def test_ids_are_made_safe_and_collisions_kept_apart(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ann lee" / NB, "space")
    write_nb(src / "ann_lee" / NB, "underscore")
    write_nb(src / "ANN LEE" / NB, "capital")
    write_nb(src / "李雷" / NB, "hanzi")
    intakes, _ = run(tmp_path, src)
    assert marker(intakes["ann_lee"].notebooks[NB]) == "# underscore"  # the folder already named so keeps it
    others = {marker(i.notebooks[NB]) for s, i in intakes.items() if s.casefold().startswith("ann_lee-")}
    assert others == {"# space", "# capital"}
    assert sorted(intakes) == ["ANN_LEE-2", "ann_lee", "ann_lee-3", "student-" + sorted(intakes)[-1][8:]]
    assert "folder 'ann lee' gives the same id as 'ann_lee'; listed as 'ann_lee-3'" in problems(intakes["ann_lee-3"])
    assert "another folder" in problems(intakes["ann_lee"])
    (hanzi,) = [i for s, i in intakes.items() if s.startswith("student-")]
    assert marker(hanzi.notebooks[NB]) == "# hanzi"


@pytest.mark.parametrize("name, expected", [("a/../b", "a_._b"), ("..", None), (" bob@uni.edu ", "bob@uni.edu"),
                                            ("x:y*z?", "x_y_z"), ("Renée", "Renee")])
def test_safe_id(name, expected):
    result = safe_id(name)
    assert all(c.isascii() and (c.isalnum() or c in "-_.@") for c in result) and ".." not in result
    if expected:
        assert result == expected


# --- empty and broken sources -----------------------------------------------------------------------------


def test_empty_student_folder_and_empty_zip(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ok" / NB)
    (src / "empty").mkdir()
    (src / "emptyzip.zip").write_bytes(zip_bytes({}))
    intakes, _ = run(tmp_path, src)
    assert intakes["empty"].status == "missing" and "empty submission" in problems(intakes["empty"])
    assert intakes["emptyzip"].status == "missing" and "empty submission" in problems(intakes["emptyzip"])


def test_empty_top_level_zip_warns(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({}))
    intakes, warnings = run(tmp_path, source, roster=["pat"])
    assert intakes["pat"].status == "missing" and "no student folders found" in warnings[0]


def test_broken_student_zip(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ok" / NB)
    (src / "quin.zip").write_bytes(b"PK\x03\x04 truncated")
    quin = run(tmp_path, src)[0]["quin"]
    assert quin.status == "missing" and "quin.zip is not a readable zip file" in problems(quin)


@pytest.mark.parametrize("make", ["missing", "text", "fake zip"])
def test_unreadable_source_raises_one_line(tmp_path, make):
    source = tmp_path / "subs.zip"
    if make == "text":
        source.write_text("hello")
    elif make == "fake zip":
        # An end record pointing at a central directory that is not there: looks like a zip, opens as none.
        source.write_bytes(b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, 46, 0, 0))
    with pytest.raises(SubmissionsError) as error:
        run(tmp_path, source)
    assert "\n" not in str(error.value) and str(source) in str(error.value) or "subs.zip" in str(error.value)


def test_zip_bomb_in_a_student_folder_is_refused(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ok" / NB)
    (src / "rex").mkdir()
    (src / "rex" / "submission.zip").write_bytes(zip_bytes({NB: b"\x00" * 2_000_000}))
    intakes, _ = run(tmp_path, src, max_total_bytes=1_000_000)
    rex = intakes["rex"]
    assert rex.status == "missing" and "over the 1 MB limit for all submissions; not unpacked" in problems(rex)
    assert intakes["ok"].status == "ok"


def test_zip_with_too_many_members_is_refused(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"s{i}/{NB}": "{}" for i in range(30)}))
    with pytest.raises(SubmissionsError, match="30 entries, over the limit of 20"):
        run(tmp_path, source, max_members=20)


# --- roster ----------------------------------------------------------------------------------------------


def test_roster_marks_unknown_and_absent_students(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "Sam" / NB)
    write_nb(src / "stranger" / NB)
    intakes, _ = run(tmp_path, src, roster=["sam", "tess"])
    assert sorted(intakes) == ["sam", "stranger", "tess"]
    assert intakes["sam"].status == "ok" and "matched to roster id 'sam'" in problems(intakes["sam"])
    assert intakes["stranger"].status == "not-on-roster" and NB in intakes["stranger"].notebooks
    assert intakes["tess"].status == "missing" and intakes["tess"].problems == ["no submission found"]
    assert intakes["tess"].line() == "tess: missing - no submission found"


def test_load_roster_formats(tmp_path):
    (tmp_path / "a.csv").write_text("name,student,email\nA,alice,a@x\nB,bob,b@x\n")
    (tmp_path / "b.csv").write_text("\ufeffid;section\ncarol;1\n")
    (tmp_path / "c.txt").write_text("dan\n\neve\ndan\n")
    (tmp_path / "d.csv").write_text("name,email\nA,a@x\n")
    assert load_roster(tmp_path / "a.csv") == ["alice", "bob"]
    assert load_roster(tmp_path / "b.csv") == ["carol"]
    assert load_roster(tmp_path / "c.txt") == ["dan", "eve"]
    with pytest.raises(SubmissionsError, match="no 'student' or 'id' column"):
        load_roster(tmp_path / "d.csv")


def test_scratch_can_be_reused(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"uma/{NB}": notebook_text("uma")}))
    run(tmp_path, source)
    again = run(tmp_path, source)[0]["uma"]
    assert again.status == "ok" and marker(again.notebooks[NB]) == "# uma"
