"""The ``%migrate`` picker: each GPU with a memory bar, its utilisation and its kernels, this kernel's GPU
marked, a target picker, a Migrate button, a progress bar that follows the phases, and the result or
the error in place. Built from ipywidgets' stock controls, so it renders wherever ipywidgets does.

The picker offers only the GPUs the server says this kernel can go to now (the ``targets`` of its
kernel view, checked with the same rules as the move itself) and shows why the others cannot take it.
The progress bar counts the phases of the operation's own plan (its ``phases``).
"""

from __future__ import annotations

import html
import threading

import ipywidgets as w
from IPython.display import display

from ..opformat import GB, describe, failure, gb, progress
from .client import ApiError, MigrateFailed, ServerClient, release_torch_cache


def _error(text: str) -> str:
    return f"<span style='color:var(--jp-error-color1)'>{html.escape(text)}</span>"


class MigrateWidget:
    def __init__(self, client: ServerClient) -> None:
        self.client = client
        self.rows = w.VBox()
        self.target = w.Dropdown(description="Move to", options=[], layout=w.Layout(width="240px"))
        self.button = w.Button(description="Migrate", button_style="primary", icon="exchange")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="",
                                      layout=w.Layout(visibility="hidden"))
        self.reasons = w.HTML()
        self.message = w.HTML()
        self.moving = False
        self.button.on_click(self._on_click)
        self.box = w.VBox([w.HTML("<b>GPUs</b>"), self.rows, w.HBox([self.target, self.button]), self.reasons,
                           self.progress, self.message])
        self.refresh()

    def show(self) -> None:
        display(self.box)

    def refresh(self) -> None:
        gpus = self.client.gpus()["gpus"]
        me = self.client.me()
        mine = {g["index"] for g in me.get("gpus") or []}  # a kernel may hold several GPUs
        self.rows.children = [self._gpu_row(g, mine) for g in gpus] or [
            w.HTML("No NVIDIA GPU is visible to the Jupyter server: there is nowhere to move this kernel.")
        ]
        by_index = {g["index"]: g for g in gpus}
        targets = me.get("targets") or []
        choices = [(f"GPU {t['index']} ({self._free(by_index.get(t['index']))} GB free)", t["index"])
                   for t in targets if t["ok"]]
        refused = [f"GPU {t['index']}: {t['reason']}" for t in targets if not t["ok"] and t["index"] not in mine]
        if len(mine) > 1 and refused:  # one sentence for every GPU: how to name a GPU for each (%migrate --to-gpu)
            refused = [refused[0].split(": ", 1)[1]]
        self.reasons.value = "<br>".join(html.escape(r) for r in refused)
        self.target.options = choices
        self.target.value = choices[0][1] if choices else None
        self.button.disabled = not choices
        if not mine and gpus and not self.moving:
            self.message.value = "This kernel holds no GPU memory: there is nothing to move."

    @staticmethod
    def _free(g: dict | None) -> str:
        return "?" if g is None else f"{(g['memory_total'] - g['memory_used']) / GB:.0f}"

    @staticmethod
    def _gpu_row(g: dict, mine: set[int]) -> w.Widget:
        used, total = g["memory_used"], g["memory_total"]
        bar = w.FloatProgress(value=used, min=0, max=max(total, 1), description=f"GPU {g['index']}",
                              bar_style="info" if g["index"] in mine else "")
        util = "-" if g["utilization"] is None else f"{g['utilization']}%"
        kernels = ", ".join(k["id"][:8] for k in g["kernels"]) or "no kernels"
        here = " <b>◀ this kernel</b>" if g["index"] in mine else ""
        text = (f"{html.escape(g['name'])}: {gb(used)} / {gb(total)} GB, util {util}; "
                f"{html.escape(kernels)}{here}")
        return w.HBox([bar, w.HTML(text)])

    def _on_click(self, _button: w.Button) -> None:
        if self.moving:
            return  # a click that raced the button's disabling: the move under way goes on
        to_gpu = self.target.value
        if to_gpu is None:
            # Nothing is asked of the server: say here why there is nothing to click.
            self.progress.value, self.progress.bar_style = 0, "danger"
            self.progress.layout.visibility = "visible"
            why = ("there is no GPU this kernel can move to now" + (" (see the reasons above)"
                   if self.reasons.value else "")) if not self.target.options else "pick a GPU in 'Move to' first"
            self.message.value = _error(f"Nothing to migrate to: {why}.")
            return
        # The move runs in a thread: the kernel must stay free to handle its messages meanwhile.
        self.moving = True
        self.button.disabled = True
        self.progress.value, self.progress.bar_style = 0, ""
        self.progress.layout.visibility = "visible"
        self.message.value = "Starting…"
        threading.Thread(target=self._move, args=(to_gpu,), daemon=True).start()

    def _move(self, to_gpu: int) -> None:
        try:
            release_torch_cache()
            op = self.client.follow(self.client.migrate(to_gpu), self._on_change)
            # The message first, then the bar's colour: a frontend that sees the colour has the sentence.
            if op["status"] == "succeeded":
                self.message.value = html.escape(describe(op))
                self._show_progress(op)
                self.progress.value, self.progress.bar_style = self.progress.max, "success"
            else:
                self.message.value = _error(failure(op))
                self.progress.bar_style = "danger"
        except (ApiError, MigrateFailed) as exc:
            self.message.value = _error(str(exc))
            self.progress.bar_style = "danger"
        finally:
            self.moving = False
            try:
                self.refresh()
            except ApiError:
                self.button.disabled = False

    def _show_progress(self, op: dict) -> None:
        done, of = progress(op)
        if of:  # an operation without its list of phases leaves the bar as it is
            self.progress.max = of
            self.progress.value = done

    def _on_change(self, op: dict) -> None:
        if op.get("status") in ("succeeded", "failed"):
            return  # _move says how it ended
        self._show_progress(op)
        if op.get("phase"):
            self.message.value = f"{op['phase']}…"
