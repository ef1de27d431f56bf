"""tqdm bars whose saved notebook output reads what the loop ended at.

`tqdm.auto` draws an ipywidgets bar in a notebook, and a notebook saves that output with the
text it had when it was first shown ("0/10"): nbconvert, a markdown export, GitHub or any
viewer without the widget state then shows a loop that never ran. `progress` draws the same
bar, and when it closes it republishes the output under the same display id, so the saved
text is the final one ("10/10", or "4/10" on the step that failed). Outside a notebook it is
`tqdm.auto.tqdm` itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

__all__ = ["progress"]


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: int | None = None,
    initial: int = 0,
    disable: bool = False,
) -> Any:
    """A tqdm bar over `iterable` (or one driven by `update` when None).

    Args:
        iterable: What to iterate; None for a bar advanced with `.update(n)`.
        desc: The bar's label.
        total: Its length (default: `len(iterable)` where it has one).
        initial: Where a resumed bar starts.
        disable: No bar at all (the iterable is still iterated).

    Returns:
        A tqdm instance: iterate it, or call `.update`, `.set_postfix` and `.close`.
    """
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm_notebook

    if disable or not issubclass(tqdm, tqdm_notebook):
        return tqdm(iterable, desc=desc, total=total, initial=initial, disable=disable)
    return _saved_bar_class()(iterable, desc=desc, total=total, initial=initial)


@functools.cache
def _saved_bar_class() -> type:
    from IPython.display import display
    from tqdm.notebook import tqdm_notebook

    class SavedBar(tqdm_notebook):
        """A notebook bar shown under a display id and republished, final, when it closes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, display=False, **kwargs)
            self._handle = display(self.container, display_id=True)
            self.displayed = True

        def close(self) -> None:
            super().close()
            handle, self._handle = getattr(self, "_handle", None), None
            if handle is not None:
                # The widget view again, now with the bar's final text as its text/plain.
                handle.update(self.container)

    return SavedBar
