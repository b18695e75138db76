"""Transformers, Step by Step: the reference implementation of every component in the course.

Each module is one chapter's finished component (``attention`` is chapter 01, and so on:
:data:`stepformer.chapters.CHAPTER`), and imports only the modules of its own and earlier
chapters, so that importing chapter *n* loads nothing a reader has not met by chapter *n*. This
file therefore imports nothing. ``checks`` holds the exercise checks that the notebooks call (they
never import the library), ``course`` the tools that build the student release and grade
submissions.
"""
