"""What students see in their feedback: which checks failed and why, never the hidden checks."""

from nbconvert.preprocessors import Preprocessor
from nbgrader import utils


class ShortTracebacks(Preprocessor):
    """Cut a graded cell's traceback down to its last line (the check's message).

    nbgrader clears hidden tests from a cell's source, but a failing hidden check's traceback
    quotes the lines around it; the message itself says what is wrong and where to look.
    """

    enabled = True

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and utils.is_grade(cell):
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources
