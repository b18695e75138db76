"""The course's own tools: keep solutions in step with the library, release, grade."""
