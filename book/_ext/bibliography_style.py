"""The bibliography's entries labelled as the chapters cite them: "Vaswani et al. 2017", not "VSP+17".

sphinxcontrib-bibtex formats the lists with a pybtex style; this one is pybtex's ``unsrt`` (which
links each DOI and arXiv identifier) with author-year labels, sorted by author, then year.
"""

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting.author_year_title import SortingStyle
from sphinx.application import Sphinx


def _surname(person) -> str:
    return Text.from_latex(" ".join(person.prelast_names + person.last_names)).render_as("text")


class AuthorYearLabels(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        labels = list(self._author_year(sorted_entries))
        # Two works of the same authors and year are told apart as the text cites them: 2014a, 2014b.
        repeated = {label for label in labels if labels.count(label) > 1}
        seen: dict[str, int] = {}
        for label in labels:
            if label in repeated:
                seen[label] = seen.get(label, 0) + 1
                label += "abcdefghijklmnopqrstuvwxyz"[seen[label] - 1]
            yield label

    @staticmethod
    def _author_year(sorted_entries):
        for entry in sorted_entries:
            people = entry.persons.get("author", [])
            if len(people) == 1:
                names = _surname(people[0])
            elif len(people) == 2:
                names = f"{_surname(people[0])} and {_surname(people[1])}"
            else:
                names = f"{_surname(people[0])} et al."
            yield f"{names} {entry.fields.get('year', '')}".strip()


class AuthorYearStyle(UnsrtStyle):
    default_label_style = AuthorYearLabels
    default_sorting_style = SortingStyle


def setup(app: Sphinx) -> dict[str, object]:
    register_plugin("pybtex.style.formatting", "author_year_labels", AuthorYearStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
