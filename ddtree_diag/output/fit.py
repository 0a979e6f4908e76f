"""Rich tables that fit the console's width without cutting numbers or headers.

A table is described once as columns (header, kind, cells) and rendered in the first layout that
fits: the free-text column (a case's output, a diff's changes) shrinks first, then the borders go,
then the free-text column is left out, then columns that hold nothing but "unknown", and last the
table splits (keys and numbers, then keys and text; or three tables sharing the row number).
Number columns never wrap and are never narrower than their header or their widest cell; text
columns may wrap at spaces. The free-text column also folds text written without spaces (Chinese,
Japanese, a glued run of garbage) at character boundaries, by display width (a CJK character is
two cells), so an answer in such a language shrinks like any other instead of being left out.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Lines, Text

from ddtree_diag.output.cells import DASH

NUMBER, TEXT, FREE = "number", "text", "free"  # column kinds: FREE = the column to shrink or drop first


@dataclass
class Column:
    header: str
    kind: str = NUMBER
    justify: str = "right"
    cells: list[Any] = field(default_factory=list)  # str or rich Text, one per row
    key: bool = False  # identifies the row: repeated in both halves of a split table

    @property
    def unknown_only(self) -> bool:
        return bool(self.cells) and all(_plain(c) in (DASH, "") for c in self.cells)


FOLD_WORDS_OVER = 12  # cells: a longer run without a break may be folded anywhere

# Marks a line should not start with (closing punctuation, CJK or not): kept with what precedes.
_NO_LINE_START = set("、。，．・：；？！）」』】〕〉》〙〗｝］｠’”…‥ー々ゝゞヽヾ")
_NO_LINE_START |= set("ぁぃぅぇぉっゃゅょゎァィゥェォッャュョヮヵヶ" ",.;:!?)]}%")
_SPACE = re.compile(r"\s")


def _clusters(text: str) -> list[tuple[int, int]]:
    """(start, end) of each user-perceived character: combining marks, variation selectors,
    skin tones and zero-width-joined parts stay with their base."""
    spans: list[tuple[int, int]] = []
    for index, char in enumerate(text):
        joins = spans and (
            unicodedata.category(char) in ("Mn", "Me", "Mc")
            or char in "\u200d\ufe0e\ufe0f"
            or 0x1F3FB <= ord(char) <= 0x1F3FF
            or text[index - 1] == "\u200d"
        )
        if joins:
            spans[-1] = (spans[-1][0], index + 1)
        else:
            spans.append((index, index + 1))
    return spans


def _atoms(text: str) -> list[tuple[int, int, int]]:
    """The pieces a line may break between, as (start, end, width without trailing spaces): a
    run of narrow characters (a word), or a single wide character (CJK breaks anywhere), each
    with the closing punctuation and the spaces that follow it."""
    atoms: list[list[int]] = []  # [start, end, width]
    after_space = previous_wide = True
    for start, end in _clusters(text):
        char = text[start:end]
        width = cell_len(char)
        if _SPACE.match(char):
            if atoms:
                atoms[-1][1] = end
            else:
                atoms.append([start, end, 0])
            after_space = True
            continue
        glue = atoms and not after_space and (char in _NO_LINE_START or (width < 2 and not previous_wide))
        if glue:
            atoms[-1][1] = end
            atoms[-1][2] += width
        else:
            atoms.append([start, end, width])
        after_space, previous_wide = False, width >= 2
    return [(a, b, w) for a, b, w in atoms]


def fold_offsets(text: str, width: int) -> list[int]:
    """Where to break ``text`` (one line) into lines of at most ``width`` cells: between words, or
    between any two characters of unspaced text, and inside a word only when it alone is wider
    than a line."""
    width = max(width, 2)
    offsets: list[int] = []
    used = 0  # cells on the current line, spaces after its last piece included
    for start, end, atom_width in _atoms(text):
        if used and used + atom_width > width:
            offsets.append(start)
            used = 0
        if atom_width > width:  # a piece wider than a line: fold it at character boundaries
            content = text[start:end].rstrip()
            for c_start, c_end in _clusters(content):
                char_width = cell_len(content[c_start:c_end])
                if used and used + char_width > width:
                    offsets.append(start + c_start)
                    used = 0
                used += char_width
            used += cell_len(text[start:end]) - cell_len(content)
        else:
            used += cell_len(text[start:end])
    return offsets


class Folded(Text):
    """Text whose lines break between words and also inside unspaced text (see ``fold_offsets``);
    its minimum width is its widest unbreakable piece, at most ``FOLD_WORDS_OVER`` cells."""

    def __rich_measure__(self, console: Console, options: Any) -> Measurement:
        measured = super().__rich_measure__(console, options)
        widest = max((w for line in self.plain.splitlines() for *_, w in _atoms(line)), default=0)
        return Measurement(min(measured.minimum, widest, FOLD_WORDS_OVER) or measured.minimum, measured.maximum)

    def wrap(self, console: Console, width: int, *, justify: Any = None, overflow: Any = None,
             tab_size: int = 8, no_wrap: bool | None = None) -> Lines:
        if no_wrap or self.no_wrap:
            return super().wrap(console, width, justify=justify, overflow=overflow, tab_size=tab_size, no_wrap=no_wrap)
        lines = Lines()
        for line in self.split(allow_blank=True):
            if "\t" in line:
                line.expand_tabs(tab_size)
            pieces = line.divide(fold_offsets(line.plain, width))
            for piece in pieces:
                piece.rstrip_end(width)
                piece.truncate(width, overflow="fold")
            lines.extend(pieces)
        return lines


def folded(cell: Any) -> Folded:
    if isinstance(cell, Text):
        return Folded(cell.plain, style=cell.style, spans=list(cell.spans))
    return Folded(str(cell))


def _as_text(cell: Any) -> Any:
    return Text(cell) if isinstance(cell, str) else cell


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


@dataclass(frozen=True)
class Layout:
    boxed: bool = True
    free_min: int | None = 20  # min width of the FREE column; None = leave it out
    drop_unknown: bool = False
    # 1: one table; 2: keys + numbers, then keys + text; 3: keys, then # + numbers, then # + text
    split: int = 1


LAYOUTS = (
    Layout(),
    Layout(free_min=10),
    Layout(boxed=False, free_min=12),  # borders carry no information: they go before the output
    Layout(boxed=False, free_min=None),
    Layout(boxed=False, free_min=None, drop_unknown=True),
    Layout(boxed=False, free_min=12, drop_unknown=True, split=2),
    Layout(boxed=False, free_min=None, drop_unknown=True, split=2),
    Layout(boxed=False, free_min=12, drop_unknown=True, split=3),
    Layout(boxed=False, free_min=None, drop_unknown=True, split=3),
)

# Like rich's SIMPLE (no vertical rules, a rule under the header) in plain ASCII, for logs.
SIMPLE_ASCII = box.Box("    \n    \n -- \n    \n    \n -- \n    \n    \n", ascii=True)


def _table(columns: list[Column], layout: Layout, console: Console, title: str | None) -> Table:
    title = _as_text(title) if title else title
    if layout.boxed:
        style = box.HEAVY_HEAD if console.is_terminal else box.ASCII
        table = Table(title=title, title_justify="left", box=style)
    else:  # no vertical rules: one space between columns
        table = Table(title=title, title_justify="left", box=box.SIMPLE if console.is_terminal else SIMPLE_ASCII,
                      show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    rows = len(columns[0].cells) if columns else 0
    for column in columns:
        widest = max([len(word) for c in column.cells for word in _plain(c).split()] + [0])
        options: dict[str, Any] = {"justify": column.justify, "min_width": len(column.header)}
        if column.kind == NUMBER:
            options.update(no_wrap=True, min_width=max(len(column.header), *(len(_plain(c)) for c in column.cells)))
        elif column.kind == FREE:
            options.update(overflow="fold", min_width=max(len(column.header), layout.free_min or 0))
        else:
            options.update(overflow="fold", min_width=max(len(column.header), min(widest, 24)))
        table.add_column(column.header, **options)
    for index in range(rows):
        # strings as Text: a server's words (``[/]`` in an answer) are never read as rich markup
        table.add_row(*((folded if column.kind == FREE else _as_text)(column.cells[index]) for column in columns))
    return table


def min_width(console: Console, table: Table) -> int:
    return Measurement.get(console, console.options.update_width(10_000), table).minimum


def fit_tables(
    console: Console,
    columns: list[Column],
    title: str | None = None,
    *,
    on_dropped: Callable[[str], None] | None = None,
) -> list[Table | Text]:
    """What to print for ``columns`` at ``console.width``: one table, or a title line and the
    tables of a split layout."""
    width = console.width
    tables: list[Table] = []
    for layout in LAYOUTS:
        chosen = [c for c in columns if not (layout.drop_unknown and c.unknown_only and not c.key)]
        if layout.free_min is None:
            chosen = [c for c in chosen if c.kind != FREE]
        keys = [c for c in chosen if c.key]
        numbers = [c for c in chosen if not c.key and c.kind == NUMBER]
        texts = [c for c in chosen if not c.key and c.kind != NUMBER]
        if layout.split == 1:
            groups = [chosen]
        elif layout.split == 2:
            groups = [keys + numbers, keys + texts]
        else:  # the first key column (the row number) ties the three tables together
            groups = [keys, keys[:1] + numbers, keys[:1] + texts]
        # A split layout prints the title as its own line (wrapped at the console's width).
        tables = [_table(group, layout, console, title if layout.split == 1 else None) for group in groups]
        if all(min_width(console, t) <= width for t in tables):
            break
    left_out = [c.header for c in columns if c.header not in {str(col.header) for t in tables for col in t.columns}]
    if left_out and on_dropped is not None:
        on_dropped(", ".join(left_out))
    if len(tables) > 1 and title:
        return [Text(title), *tables]
    return tables


def print_tables(console: Console, tables: list[Table | Text]) -> None:
    """Print ``tables``; off a terminal (a log, a pipe) every boxed table gets the plain ASCII box,
    a stable layout for logs."""
    for table in tables:
        if isinstance(table, Table) and not console.is_terminal and table.box is not None and not table.box.ascii:
            table.box = box.ASCII
        console.print(table)
