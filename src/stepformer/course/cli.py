"""``stepformer-course``: the instructor's commands (sync, release, new-assignment, grade, grade-worker,
grade-finish, feedback, export, class-edition)."""

import argparse
import os
import sys
from pathlib import Path

from stepformer.course.paths import CourseNotFound, assignments, course_root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepformer-course", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    sync_cmd = commands.add_parser("sync", help="fill the solution cells from the library in src/")
    sync_cmd.add_argument("--check", action="store_true", help="change nothing; fail if a cell is stale")
    sync_cmd.add_argument("--assignment", action="append", help="only this assignment (repeatable); default: all")

    release_cmd = commands.add_parser("release", help="regenerate exercises/ with nbgrader generate_assignment")
    release_cmd.add_argument("--check", action="store_true", help="change nothing; fail if exercises/ is stale")
    release_cmd.add_argument("--assignment", action="append", help="only this assignment (repeatable); default: all")

    new_cmd = commands.add_parser("new-assignment", help="start an assignment of your own in solutions/NAME")
    new_cmd.add_argument("name", help="two digits, an underscore and a topic, e.g. 12_tokenizers")

    grade_cmd = commands.add_parser("grade", help="autograde submissions and write feedback and grades")
    grade_cmd.add_argument("submissions", type=Path, nargs="?",
                           help="a folder (one sub-folder per student) or a .zip of one; or use --course")
    grade_cmd.add_argument("--course", type=Path, default=None, metavar="DIR",
                           help="an nbgrader course folder: grade what `nbgrader collect` put in its submitted/, "
                                "in place, into its own gradebook")
    grade_cmd.add_argument("--assignment", default=None,
                           help="assignment name, e.g. 01_attention (default: the one whose notebooks were handed in, "
                                "if every notebook belongs to one)")
    grade_cmd.add_argument("--due", default=None, metavar="DATE",
                           help="due date, e.g. '2026-12-01 17:00 Europe/Paris': a timestamp.txt after it is late, "
                                "and nbgrader's LateSubmissionPlugin.penalty_method applies")
    grade_cmd.add_argument("--out", type=Path, default=Path("grades"), help="where feedback and grades.csv go")
    grade_cmd.add_argument("--workdir", type=Path, default=None,
                           help="the grader's nbgrader folder, one gradebook for all assignments, kept for resuming "
                                "and formgrader (default: autograder/work/grading)")
    grade_cmd.add_argument("--workers", type=int, default=None, help="students graded at once (default: cores)")
    grade_cmd.add_argument("--roster", type=Path, default=None, help="CSV with a 'student' column, or one id a line")
    grade_cmd.add_argument("--only", nargs="+", default=None, metavar="STUDENT",
                           help="grade just these students (e.g. one per cluster job, with a shared gradebook)")
    grade_cmd.add_argument("--fresh", action="store_true",
                           help="grade everyone again (manual scores and comments made in formgrader are kept)")
    grade_cmd.add_argument("--cell-seconds", type=int, default=None, help="time limit of one cell (default 60)")
    grade_cmd.add_argument("--notebook-seconds", type=int, default=None, help="time limit of a notebook (default 600)")
    grade_cmd.add_argument("--memory-gib", type=float, default=None, help="memory of one kernel (default 4)")
    grade_cmd.add_argument("--no-sandbox", action="store_true",
                           help="run student code without the sandbox: only for submissions you trust")
    grade_cmd.add_argument("--intake-only", action="store_true",
                           help="read the submissions and write the manifest of the students to grade, grade "
                                "nobody: grade-worker (any number, on any machine sharing the folder) and "
                                "grade-finish do the rest")

    worker_cmd = commands.add_parser("grade-worker",
                                     help="grade students of the manifest that `grade --intake-only` wrote, one at a "
                                          "time, until none is left; run as many at once as you like")
    worker_where = worker_cmd.add_mutually_exclusive_group()
    worker_where.add_argument("--workdir", type=Path, default=None,
                              help="the work folder the intake used (default: autograder/work/grading)")
    worker_where.add_argument("--course", type=Path, default=None, metavar="DIR", help="an nbgrader course folder")
    worker_cmd.add_argument("--assignment", required=True)
    worker_cmd.add_argument("--workers", type=int, default=1,
                            help="students this command grades at once (default 1: one per core it may use)")
    worker_cmd.add_argument("--limit", type=int, default=None, metavar="N", help="stop after N students")
    worker_cmd.add_argument("--take-over-after", type=float, default=None, metavar="SECONDS",
                            help="take over a claim without a result once it is this old (default: the grading "
                                 "process's own time limit plus 300 s); 0 only when no other worker runs")
    worker_cmd.add_argument("--no-progress", action="store_true", help="no progress bar (for batch logs)")

    finish_cmd = commands.add_parser("grade-finish",
                                     help="after the workers: manual scores back, grades.csv and the feedback")
    finish_where = finish_cmd.add_mutually_exclusive_group()
    finish_where.add_argument("--workdir", type=Path, default=None,
                              help="the work folder the intake used (default: autograder/work/grading)")
    finish_where.add_argument("--course", type=Path, default=None, metavar="DIR", help="an nbgrader course folder")
    finish_cmd.add_argument("--assignment", required=True)
    finish_cmd.add_argument("--out", type=Path, default=None,
                            help="where feedback and grades.csv go (default: the intake's --out)")

    feedback_cmd = commands.add_parser(
        "feedback", help="write the students' feedback again from the gradebook: manual scores and comments shown, "
                         "hidden checks never")
    feedback_cmd.add_argument("--assignment", required=True, help="assignment name, e.g. 01_attention")
    feedback_where = feedback_cmd.add_mutually_exclusive_group()
    feedback_where.add_argument("--workdir", type=Path, default=None,
                                help="the grader's work folder (default: autograder/work/grading)")
    feedback_where.add_argument("--course", type=Path, default=None, metavar="DIR", help="an nbgrader course folder")
    feedback_cmd.add_argument("--out", type=Path, default=None,
                              help="also copy each page to OUT/feedback/<student>/<assignment>/ (as grade --out does)")
    feedback_cmd.add_argument("--only", nargs="+", default=None, metavar="STUDENT",
                              help="just these students (default: everyone with a graded submission)")

    class_cmd = commands.add_parser("class-edition",
                                    help="the class edition: nbgrader source/ without printed answers, and the "
                                         "students' package (the checks without the reference code)")
    class_cmd.add_argument("--out", type=Path, required=True,
                           help="where source/ and the wheel go (say, your nbgrader course folder)")
    class_cmd.add_argument("--package-url", default=None, metavar="URL",
                           help="where the set-up cells (Colab) fetch the students' wheel; default: its file name")
    class_cmd.add_argument("--assignment", action="append", help="only this assignment (repeatable); default: all")
    class_cmd.add_argument("--replace", action="store_true",
                           help="replace source/<assignment> folders that are already there")

    export_cmd = commands.add_parser("export", help="every student x assignment, as CSV or for Canvas or Moodle")
    export_cmd.add_argument("--format", choices=("csv", "canvas", "moodle"), default="csv")
    export_cmd.add_argument("--out", type=Path, required=True, help="the file to write")
    where = export_cmd.add_mutually_exclusive_group()
    where.add_argument("--workdir", type=Path, default=None,
                       help="the grader's work folder (default: autograder/work/grading)")
    where.add_argument("--course", type=Path, default=None, metavar="DIR", help="an nbgrader course folder")
    export_cmd.add_argument("--roster", type=Path, default=None,
                            help="CSV with a 'student' column (and first_name, last_name, email, lms_user_id): "
                                 "only its students are exported")
    export_cmd.add_argument("--all-students", action="store_true",
                            help="with --roster, export the graded students who are not on it too")

    args = parser.parse_args(argv)
    try:
        root = course_root()
    except CourseNotFound as error:
        print(error, file=sys.stderr)
        return 2

    if args.command == "sync":
        from stepformer.course.sync import describe, sync

        stale = sync(root, check=args.check, names=args.assignment)
        if stale and args.check:
            print("Solution cells out of step with the library (run `make sync`):\n" + describe(stale))
            return 1
        print(f"{len(stale)} solution cell(s) updated" if stale else "solution cells match the library")
        return 0

    if args.command == "release":
        from stepformer.course.release import differences, replace_release

        if args.check:
            found = differences(root)
            if found:
                print("exercises/ is not a fresh nbgrader release (run `make release`):")
                print("\n".join(f"  {line}" for line in found))
                return 1
            print("exercises/ matches a fresh release")
            return 0
        unknown = sorted(set(args.assignment or []) - set(assignments(root)))
        if unknown:
            known = ", ".join(assignments(root))
            print(f"unknown assignment(s): {', '.join(unknown)}; known: {known}", file=sys.stderr)
            return 2
        replace_release(root, args.assignment)
        print(f"released into {root / 'exercises'}")
        return 0

    if args.command == "new-assignment":
        from stepformer.course.scaffold import ScaffoldError, new_assignment

        try:
            path = new_assignment(root, args.name)
        except ScaffoldError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {path.relative_to(root)}: edit it (solution cells, test cells with assert, a rubric in each "
              f"answer's solution), then `make release` writes the students' copy to exercises/{args.name}/")
        return 0

    if args.command == "class-edition":
        from stepformer.course.edition import EditionError, write_class_course

        try:
            source, wheel = write_class_course(root, args.out, args.package_url, args.assignment,
                                               replace=args.replace)
        except EditionError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {source} (nbgrader's source/ of the class edition), {source.parent / 'release'} (the students' "
              f"copies) and {wheel} (the students' package: pip install it on the hub's image, or put it where "
              f"--package-url points)")
        return 0

    if args.command == "feedback":
        from stepformer.course.feedback import feedback_command

        return feedback_command(root, args.assignment, workdir=args.workdir, course=args.course, out=args.out,
                                only=args.only)

    if args.command == "export":
        from stepformer.course.export import ExportError, notes, read_gradebook, read_roster, write
        from stepformer.course.worker import course_config

        folder = (args.course or args.workdir or root / "autograder" / "work" / "grading").resolve()
        config = course_config(root, folder)
        directory = config.CourseDirectory
        if not args.course and not (folder / "gradebook.db").is_file() and "STEPFORMER_DB_URL" not in os.environ:
            print(f"error: no gradebook in {folder}: grade something first, or say where (--workdir, --course)",
                  file=sys.stderr)
            return 2
        if args.all_students and not args.roster:
            print("error: --all-students only means something with --roster", file=sys.stderr)
            return 2
        try:
            assignments_, students, left_out = read_gradebook(
                directory.db_url, directory.course_id, read_roster(args.roster) if args.roster else None,
                config=config, all_students=args.all_students)
            written = write(args.out, args.format, assignments_, students)
        except ExportError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        for line in notes(args.format, assignments_, students, left_out):
            print(f"note: {line}", file=sys.stderr)
        print(f"{len(students)} students x {len(assignments_)} assignments ({args.format}):")
        print("\n".join(f"  {path}" for path in written))
        return 0

    if args.command in ("grade-worker", "grade-finish"):
        from stepformer.course.grade import grade_finish_command, grade_worker_command

        folder = args.course or args.workdir or root / "autograder" / "work" / "grading"
        if args.command == "grade-finish":
            return grade_finish_command(folder, args.assignment, args.out)
        if args.workers < 1 or (args.limit is not None and args.limit < 1):
            print("error: --workers and --limit take a number of students, 1 or more", file=sys.stderr)
            return 2
        return grade_worker_command(folder, args.assignment, workers=args.workers, limit=args.limit,
                                    take_over_after=args.take_over_after, progress=not args.no_progress)

    from stepformer.course.grade import grade_command
    from stepformer.course.sandbox import Limits

    limits = Limits(**{k: v for k, v in (("cell_seconds", args.cell_seconds),
                                         ("notebook_seconds", args.notebook_seconds),
                                         ("memory_bytes", args.memory_gib and int(args.memory_gib * 2**30)))
                       if v is not None})
    return grade_command(root, args.submissions, args.assignment, args.out, args.workdir, workers=args.workers,
                         sandbox=not args.no_sandbox, roster=args.roster, fresh=args.fresh, only=args.only,
                         limits=limits, course=args.course, due=args.due, intake_only=args.intake_only)


if __name__ == "__main__":
    sys.exit(main())
