"""nbgrader configuration of the course.

nbgrader's "source" folder is the repository's solutions/ and its "release" folder is
exercises/. Everything nbgrader writes while grading (gradebook, submitted/, autograded/,
feedback/) lives under autograder/work/, which git ignores. The grading command
(`stepformer-course grade`) loads this file and points the course root at its own work folder.
"""

from pathlib import Path

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

repo = Path(__file__).resolve().parent.parent
work = repo / "autograder" / "work"

c.CourseDirectory.root = str(repo)
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.db_url = f"sqlite:///{work / 'release-gradebook.db'}"

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# A test cell fails when it writes to stderr; PyTorch and matplotlib warnings must not cost
# a student their points (nbgrader >= 0.9.4).
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r".*(Warning|warn)\b.*"

# Seconds per cell; a solved notebook runs in well under a minute in total.
c.Execute.timeout = 60
c.Execute.interrupt_on_timeout = True

# Feedback goes back to students: the gradebook's scores and comments, which checks failed, never the
# hidden checks' code (ClearHiddenTests) or the lines around a failing one (ShortTracebacks).
from stepformer.course.feedback import safe_feedback  # noqa: E402

safe_feedback(c)
