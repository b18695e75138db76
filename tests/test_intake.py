"""Reading submissions: every kind of bad upload becomes a problem line on its student, never a crash."""

import io
import json
import os
import struct
import time
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbformat import v3

from stepformer.course.intake import (
    Intake,
    SubmissionsError,
    infer_assignment,
    load_roster,
    read_submissions,
    safe_id,
    write_lms_feedback,
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


def test_duplicate_hand_ins_of_one_student_newest_wins(tmp_path):
    """kim/, Kim/ and kim.zip are one student (ids compare without case): the newest is graded, the rest named."""
    src = tmp_path / "subs"
    old, new = 1_700_000_000, 1_700_090_000
    os.utime(write_nb(src / "kim" / NB, "oldest"), (old, old))
    os.utime(write_nb(src / "Kim" / NB, "newest"), (new, new))
    info = zipfile.ZipInfo(NB, date_time=time.localtime(old + 3600)[:6])
    with zipfile.ZipFile(src / "kim.zip", "w") as archive:
        archive.writestr(info, notebook_text("zipped"))
    intakes, warnings = run(tmp_path, src)
    assert list(intakes) == ["kim"]  # the folder already named as its id gives the spelling
    kim = intakes["kim"]
    assert kim.status == "ok" and marker(kim.notebooks[NB]) == "# newest"
    assert "3 hand-ins give the id 'kim' (ids compare without case): graded the newest, 'Kim/' (file modification " \
           "time 2023-11-15 23:13:20 UTC); set aside 'kim.zip' (file modification time 2023-11-14 23:13:20 UTC)" \
        in problems(kim)
    assert "'kim/' (file modification time 2023-11-14 22:13:20 UTC)" in problems(kim)
    assert warnings == ["kim: 3 hand-ins; graded 'Kim/', the newest; set aside 'kim.zip', 'kim/'"]


def test_timestamp_txt_decides_between_duplicates_over_file_times(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "lee" / NB, "stamped")  # its file is newer than the other's, but its hand-in time is older
    (src / "lee" / "timestamp.txt").write_text("2020-01-01 12:00:00 UTC")
    os.utime(write_nb(src / "LEE" / NB, "file time"), (1_700_000_000,) * 2)
    lee = run(tmp_path, src)[0]["lee"]
    assert marker(lee.notebooks[NB]) == "# file time"
    assert "graded the newest, 'LEE/' (file modification time 2023-11-14 22:13:20 UTC); set aside 'lee/' " \
           "(timestamp.txt 2020-01-01 12:00:00 UTC)" in problems(lee)


def test_a_hand_in_with_no_notebook_never_wins(tmp_path):
    src = tmp_path / "subs"
    os.utime(write_nb(src / "mia" / NB, "work"), (1_700_000_000,) * 2)
    (src / "Mia").mkdir()
    (src / "Mia" / "notes.txt").write_text("newer, but no notebook")
    mia = run(tmp_path, src)[0]["mia"]
    assert mia.status == "ok" and marker(mia.notebooks[NB]) == "# work" and "'Mia/' (no notebook)" in problems(mia)


def test_ids_are_made_safe_and_letters_transliterated(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "ann lee" / NB, "space")
    write_nb(src / "李雷" / NB, "hanzi")
    write_nb(src / "Đặng Văn" / NB, "vietnamese")
    intakes, _ = run(tmp_path, src)
    assert sorted(intakes) == ["Dang_Van", "LiLei", "ann_lee"]
    assert marker(intakes["LiLei"].notebooks[NB]) == "# hanzi"
    assert "folder name 'Đặng Văn' changed to the id 'Dang_Van'" in problems(intakes["Dang_Van"])


@pytest.mark.parametrize("name, expected", [("a/../b", "a_._b"), ("..", None), (" bob@uni.edu ", "bob@uni.edu"),
                                            ("x:y*z?", "x_y_z"), ("Renée", "Renee"),
                                            ("Đặng", "Dang"), ("José Núñez", "Jose_Nunez"), ("🙂", None)])
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


def test_roster_ids_are_normalised_like_folder_names(tmp_path):
    src = tmp_path / "subs"
    write_nb(src / "José Núñez" / NB, "jose")
    write_nb(src / "Đặng Văn" / NB, "dang")
    intakes, _ = run(tmp_path, src, roster=["José Núñez", "Đặng Văn", "Zoë"])
    assert sorted(intakes) == ["Dang_Van", "Jose_Nunez", "Zoe"]
    assert intakes["Jose_Nunez"].status == "ok" and intakes["Dang_Van"].status == "ok"
    assert "not on the roster" not in problems(intakes["Jose_Nunez"]) + problems(intakes["Dang_Van"])
    assert intakes["Zoe"].status == "missing"
    assert intakes["Zoe"].problems == ["no submission found", "roster id 'Zoë' is 'Zoe' here"]


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


# --- hand-in times, digests ------------------------------------------------------------------------------


def test_timestamp_txt_inside_a_zip_is_read(tmp_path):
    source = tmp_path / "subs.zip"
    source.write_bytes(zip_bytes({f"ola/{A}/{NB}": notebook_text("ola"),
                                  f"ola/{A}/timestamp.txt": "2026-12-02 09:30:00.000000 UTC"}))
    ola = run(tmp_path, source)[0]["ola"]
    assert ola.timestamp == "2026-12-02 09:30:00.000000 UTC" and ola.problems == []
    assert ola.handed_in_from == "timestamp.txt"


def test_the_same_notebook_gives_the_same_digest_every_run(tmp_path):
    """Cells without ids (allowed before nbformat 4.5) get the same ids every run, so a digest is stable."""
    src = tmp_path / "subs"
    data = json.loads(notebook_text("stable"))
    data["cells"][0].pop("id")
    (src / "pat").mkdir(parents=True)
    (src / "pat" / NB).write_text(json.dumps(data), encoding="utf-8")
    first = run(tmp_path, src)[0]["pat"]
    second = run(tmp_path, src)[0]["pat"]
    assert first.digests == second.digests and len(first.digests[NB]) == 64
    assert first.notebooks[NB] != second.notebooks[NB]  # each run writes its own copies
    write_nb(src / "pat" / NB, "changed")
    assert run(tmp_path, src)[0]["pat"].digests != first.digests
    # An old format converted to v4: the conversion's cell ids are made the same every run too.
    old = v3.new_notebook(worksheets=[v3.new_worksheet(cells=[v3.new_code_cell(input="# old")])])
    (src / "pat" / NB).write_text(v3.writes_json(old), encoding="utf-8")
    assert run(tmp_path, src)[0]["pat"].digests == run(tmp_path, src)[0]["pat"].digests


# --- LMS downloads ---------------------------------------------------------------------------------------


def canvas_zip(path: Path) -> Path:
    """A Canvas "Download Submissions" zip, named as canvas-lms's ContentZipper names its members."""
    path.write_bytes(zip_bytes({
        f"smithjane_LATE_1201_90001_{NB}": notebook_text("jane"),
        "doejohn_1202_90002_Attention-1.ipynb": notebook_text("john"),  # a resubmission: Canvas adds -1
        "doejohn_1202_90003_notes.txt": "notes",
        "nunezjose_1203_90004_attention.ipynb": notebook_text("jose"),
        f"LATE_anon_Xy7Kq_90005_{NB}": notebook_text("anonymous"),
        "leeann_1204_text.html": "<p>a text entry</p>",
    }))
    return path


def test_a_canvas_download_is_read_with_its_ids_and_late_marks(tmp_path):
    intakes, warnings = run(tmp_path, canvas_zip(tmp_path / "submissions.zip"))
    assert sorted(intakes) == ["anon_Xy7Kq", "doejohn", "leeann", "nunezjose", "smithjane"]
    jane, john = intakes["smithjane"], intakes["doejohn"]
    assert jane.status == "ok" and marker(jane.notebooks[NB]) == "# jane"
    assert "read as a Canvas download" in problems(jane)
    assert "marked late by Canvas (the download gives no hand-in time, so no late penalty is applied)" in problems(jane)
    assert jane.lms == {"layout": "canvas", "name": "smithjane", "user_id": "1201",
                        "prefix": "smithjane_LATE_1201_90001", "late": "yes"}
    assert john.status == "ok" and marker(john.notebooks[NB]) == "# john" and "marked late" not in problems(john)
    assert "ignored 1 extra file" in problems(john) and john.lms["prefix"] == "doejohn_1202_90002"
    assert "marked late by Canvas" in problems(intakes["anon_Xy7Kq"])
    assert intakes["leeann"].status == "missing"
    assert warnings == ["recognised a Canvas download: 5 students"]
    # A roster may name Canvas students by their name as Canvas shows it, or by Canvas's user id.
    rostered, _ = run(tmp_path, canvas_zip(tmp_path / "again.zip"), roster=["Smith, Jane", "1202", "Núñez, José"])
    assert rostered["Smith_Jane"].status == "ok" and rostered["1202"].status == "ok"
    assert rostered["Nunez_Jose"].status == "ok" and rostered["leeann"].status == "not-on-roster"


def test_a_canvas_download_infers_the_assignment(tmp_path):
    source = canvas_zip(tmp_path / "submissions.zip")
    assert infer_assignment(source, {A: [NB], "03_multihead": ["multihead.ipynb"]}, tmp_path / "scratch") == A


def test_a_moodle_download_is_read_with_folders_or_without(tmp_path):
    src = tmp_path / "moodle"
    write_nb(src / "Jane Smith_2201_assignsubmission_file_" / NB, "jane")
    (src / "Jane Smith_2201_assignsubmission_onlinetext_").mkdir()
    (src / "Jane Smith_2201_assignsubmission_onlinetext_" / "onlinetext.html").write_text("<p>hi</p>")
    write_nb(src / "José Núñez_2202_assignsubmission_file" / "sub" / NB, "jose")  # Moodle 4.1+: no final "_"
    write_nb(src / "Wei Zhang_2203_assignsubmission_file_" / NB, "wei one")
    write_nb(src / "Wei Zhang_2204_assignsubmission_file_" / NB, "wei two")
    write_nb(src / f"Ann Lee_2205_assignsubmission_file_{NB}", "ann")  # "download submissions in folders" off
    intakes, warnings = run(tmp_path, src)
    assert sorted(intakes) == ["Ann_Lee", "Jane_Smith", "Jose_Nunez", "Wei_Zhang_2203", "Wei_Zhang_2204"]
    assert all(i.status == "ok" for i in intakes.values()), {s: i.problems for s, i in intakes.items()}
    jane = intakes["Jane_Smith"]
    assert marker(jane.notebooks[NB]) == "# jane" and "read as a Moodle download" in problems(jane)
    assert "ignored 'Jane Smith_2201_assignsubmission_onlinetext_'" in problems(jane)
    assert jane.lms == {"layout": "moodle", "name": "Jane Smith", "participant": "2201",
                        "folder": "Jane Smith_2201_assignsubmission_file_"}
    assert intakes["Jose_Nunez"].lms["folder"] == "José Núñez_2202_assignsubmission_file"
    assert marker(intakes["Wei_Zhang_2204"].notebooks[NB]) == "# wei two"
    assert intakes["Ann_Lee"].lms["folder"] == "Ann Lee_2205_assignsubmission_file_"
    assert warnings == ["recognised a Moodle download: 5 students"]


def test_a_lone_moodle_student_is_not_unwrapped(tmp_path):
    source = tmp_path / "one.zip"
    source.write_bytes(zip_bytes({f"Jane Smith_2201_assignsubmission_file_/{A}/{NB}": notebook_text("jane")}))
    assert list(run(tmp_path, source)[0]) == ["Jane_Smith"]


def test_feedback_is_written_in_each_lms_bulk_upload_layout(tmp_path):
    out = tmp_path / "out"
    for student in ("Jane_Smith", "smithjane", "absent"):
        (out / "feedback" / student / A).mkdir(parents=True)
    for student in ("Jane_Smith", "smithjane"):
        (out / "feedback" / student / A / "attention.html").write_text(f"<p>{student}</p>")
    moodle = {"layout": "moodle", "folder": "Jane Smith_2201_assignsubmission_file_", "participant": "2201"}
    canvas = {"layout": "canvas", "prefix": "smithjane_LATE_1201_90001", "user_id": "1201"}
    written = write_lms_feedback(out, A, [("Jane_Smith", moodle), ("smithjane", canvas), ("absent", canvas),
                                          ("plain", {})])
    assert written == [out / "feedback-moodle.zip", out / "feedback-canvas.zip"]
    with zipfile.ZipFile(out / "feedback-moodle.zip") as archive:
        assert archive.namelist() == ["Jane Smith_2201_assignsubmission_file_/attention.html"]
        assert archive.read(archive.namelist()[0]) == b"<p>Jane_Smith</p>"
    with zipfile.ZipFile(out / "feedback-canvas.zip") as archive:
        # Canvas reads the first two all-digit parts of the name as the user and the submitted file.
        assert archive.namelist() == ["smithjane_LATE_1201_90001_attention.html"]
