// What the panel and the status bar show: kernels, GPUs, notebooks and operations in flight, kept fresh
// by the server's events (each phase of each operation), the sessions' changes, and a modest poll for
// GPU memory while the panel is visible.
import { Notification } from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { Event, ServiceManager } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { api, EVENT_SCHEMA_ID, humanBytes, IGpu, IKernel, IOperation } from './api';

/** Milliseconds between refreshes when no event arrives (GPU memory and utilisation change without one). */
const REFRESH_MS = 5000;

export class GpuMigrateStore {
  constructor(
    private readonly services: ServiceManager.IManager,
    private readonly tracker: INotebookTracker | null = null
  ) {
    services.events.stream.connect(this._onEvent, this);
    services.sessions.runningChanged.connect(() => void this.refresh(), this);
    this._poll = new Poll({
      factory: () => this.refresh(),
      frequency: { interval: REFRESH_MS, backoff: false },
      // Only the panel shows what changes without an event (GPU memory, utilisation).
      standby: () => !this.watched || 'when-hidden',
      name: 'jupyter-gpumigrate:refresh'
    });
    void this.refresh();
  }

  kernels: IKernel[] = [];
  gpus: IGpu[] = [];
  /** Kernel id -> notebook path, from the server's sessions and the open notebooks. */
  notebooks = new Map<string, string>();
  /** Kernel id (or "gpu:N" for a drain) -> the operation in flight. */
  operations = new Map<string, IOperation>();
  /** Kernel id (or "gpu:N") -> what the request under way says ("Suspending…"), until the server answers. */
  pending = new Map<string, string>();
  /** What went wrong at the last refresh, one sentence per request that failed. */
  errors: string[] = [];
  /** Whether a kernel list has arrived yet (the panel says "Loading…" until then). */
  loaded = false;
  /** Set by the panel while it is visible: the poll stands by otherwise. */
  watched = false;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  kernel(id: string | undefined): IKernel | undefined {
    return this.kernels.find(k => k.id === id);
  }

  /** The notebook's file name, or a short kernel id. */
  label(kernelId: string): string {
    const path = this.notebooks.get(kernelId);
    return path ? PathExt.basename(path) : `kernel ${kernelId.slice(0, 8)}`;
  }

  /** Ask the server again; an answer older than one already shown is dropped. */
  async refresh(): Promise<void> {
    const seq = ++this._asked;
    const [kernels, gpus, listed] = await Promise.allSettled([
      api.kernels(),
      api.gpus(),
      // Once per page load: drains (and operations) started before it, which no kernel names.
      this.loaded ? Promise.resolve(null) : api.operations()
    ]);
    if (seq < this._shown) {
      return;
    }
    this._shown = seq;
    const errors: string[] = [];
    if (kernels.status === 'fulfilled') {
      this.kernels = kernels.value;
    } else {
      errors.push(String(kernels.reason?.message ?? kernels.reason));
    }
    if (gpus.status === 'fulfilled') {
      this.gpus = gpus.value.gpus;
    } else {
      errors.push(String(gpus.reason?.message ?? gpus.reason));
    }
    this.errors = [...new Set(errors)];
    if (listed.status === 'fulfilled' && listed.value) {
      for (const op of listed.value) {
        if (op.status === 'pending' || op.status === 'running') {
          this._track(op);
        }
      }
    }
    this.loaded = this.loaded || kernels.status === 'fulfilled';
    this._readNotebooks();
    this._emitIfChanged();
    if (kernels.status === 'fulfilled') {
      void this._reconcile();
    }
  }

  /**
   * Send one request for `key` (a kernel id or "gpu:N"); while it is under way the key's buttons are
   * disabled and say `doing`. The operation's progress then arrives as events; a refusal is a
   * notification with the server's sentence.
   */
  async start(key: string, doing: string, begin: () => Promise<IOperation>): Promise<void> {
    if (this.pending.has(key) || this.operations.has(key)) {
      return;
    }
    this.pending.set(key, doing);
    this._changed.emit();
    try {
      this._track(await begin());
    } catch (error) {
      const message = error instanceof Error ? error.message : String(error);
      Notification.error(`${this._subject(key)}: ${message}`, { autoClose: false });
    } finally {
      this.pending.delete(key);
      this._changed.emit();
    }
  }

  dispose(): void {
    this._poll.dispose();
    this.services.events.stream.disconnect(this._onEvent, this);
    Signal.clearData(this);
  }

  /** Keep `op` as the one in flight for its key, unless something newer is known. */
  private _track(op: IOperation): void {
    if (this._finished.has(op.id)) {
      return;
    }
    if (op.status === 'succeeded' || op.status === 'failed') {
      this._finish(op);
      return;
    }
    const key = keyOf(op);
    const known = this.operations.get(key);
    if (known && known.id === op.id && known.version >= op.version) {
      if (!known.phases && op.phases) {
        // Known from events that lacked its plan's phases (an older server's): take them from the fetch.
        this.operations.set(key, { ...known, phases: op.phases });
        this._changed.emit();
      }
      return;
    }
    this.operations.set(key, known?.id === op.id ? { ...known, ...op } : op);
    this._changed.emit();
  }

  /** An operation ended: forget it, say how it went, and refresh. */
  private _finish(op: IOperation): void {
    if (this._finished.has(op.id)) {
      return;
    }
    this._finished.add(op.id);
    const key = keyOf(op);
    if (this.operations.get(key)?.id === op.id) {
      this.operations.delete(key);
    }
    // A drain's own moves are told by the drain's result.
    const child = [...this._drainChildren.values()].some(ids => ids.has(op.id));
    if (op.action === 'drain') {
      this._drainChildren.delete(op.id);
      this._notifyDrain(op);
    } else if (!child) {
      if (op.status === 'failed') {
        Notification.error(`${this._subject(key)}: ${op.error || `${op.action} failed.`}`, {
          autoClose: false
        });
      } else {
        Notification.success(`${this._subject(key)}: ${describe(op)}`, { autoClose: 5000 });
      }
    }
    this._changed.emit();
    void this.refresh();
  }

  private _notifyDrain(op: IOperation): void {
    const results = op.results ?? [];
    const moved = results.filter(r => r.status === 'succeeded');
    const stuck = results.filter(r => r.status !== 'succeeded');
    const where = moved
      .map(r => {
        const to = r.to_gpu === null || r.to_gpu === undefined ? 'the CPU' : `GPU ${r.to_gpu}`;
        return `${this.label(r.kernel_id)} ${r.way === 'transplant' ? 'transplanted ' : ''}to ${to}`;
      })
      .join(', ');
    if (op.status === 'succeeded') {
      const summary = results.length ? `${moved.length} moved (${where})` : 'no kernel was on it';
      Notification.success(`GPU ${op.gpu} drained: ${summary}.`, { autoClose: 8000 });
    } else if (stuck.length) {
      const why = stuck.map(r => `${this.label(r.kernel_id)}: ${r.error ?? r.status}`).join('; ');
      Notification.error(
        `GPU ${op.gpu} drain: ${moved.length} of ${results.length} moved` +
          `${where ? ` (${where})` : ''}; not moved, still running there: ${why}`,
        { autoClose: false }
      );
    } else {
      Notification.error(`GPU ${op.gpu} drain: ${op.error || 'failed.'}`, { autoClose: false });
    }
  }

  /**
   * Bring the operations in flight in line with the kernel list: fetch the operation a kernel names
   * that is not known here (after a reload, or one started elsewhere), and the current state of one
   * the list no longer names or of a drain (their last event may have been lost while the event
   * stream reconnected).
   */
  private async _reconcile(): Promise<void> {
    const ids = new Set<string>();
    for (const kernel of this.kernels) {
      const known = this.operations.get(kernel.id);
      if (kernel.operation && known?.id !== kernel.operation) {
        ids.add(kernel.operation);
      }
    }
    for (const [key, op] of this.operations) {
      // An operation known from events without its plan's phases (an older server's) is fetched for them.
      if (key.startsWith('gpu:') || this.kernel(key)?.operation !== op.id || !op.phases) {
        ids.add(op.id);
      }
    }
    const answers = await Promise.allSettled(
      [...ids].filter(id => !this._finished.has(id)).map(id => api.operation(id))
    );
    for (const answer of answers) {
      if (answer.status === 'fulfilled') {
        this._track(answer.value);
      }
    }
    // An operation the server no longer knows (its kernel shut down): nothing left to show.
    for (const [key, op] of this.operations) {
      if (!key.startsWith('gpu:') && !this.kernel(key)) {
        this.operations.delete(key);
        this._finished.add(op.id);
        this._changed.emit();
      }
    }
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    if (event.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const data = event as unknown as IOperation & { operation_id: string };
    if (this._finished.has(data.operation_id)) {
      return;
    }
    const key = keyOf(data);
    const known = this.operations.get(key);
    const op: IOperation = {
      ...(known?.id === data.operation_id ? known : ({} as IOperation)),
      ...data,
      id: data.operation_id,
      error: data.error || null,
      phase: data.phase || null
    };
    if (op.action === 'drain') {
      this._drainChildren.set(op.id, new Set(op.children ?? []));
    }
    this._track(op);
  }

  /** Kernel ids to notebook paths: the server's sessions, then the open notebooks' own paths. */
  private _readNotebooks(): void {
    const notebooks = new Map<string, string>();
    for (const session of this.services.sessions.running()) {
      if (session.kernel) {
        notebooks.set(session.kernel.id, session.path);
      }
    }
    // What the user sees wins: an open notebook's own path (a session's lags behind some renames).
    this.tracker?.forEach(panel => {
      const id = panel.sessionContext.session?.kernel?.id;
      if (id) {
        notebooks.set(id, panel.context.path);
      }
    });
    this.notebooks = notebooks;
  }

  /** Tell the views only when what they show changed: a poll that finds nothing new redraws nothing. */
  private _emitIfChanged(): void {
    const snapshot = JSON.stringify([
      this.kernels,
      this.gpus,
      [...this.notebooks],
      this.errors,
      this.loaded
    ]);
    if (snapshot !== this._snapshot) {
      this._snapshot = snapshot;
      this._changed.emit();
    }
  }

  private _subject(key: string): string {
    return key.startsWith('gpu:') ? `GPU ${key.slice(4)}` : this.label(key);
  }

  private _changed = new Signal<this, void>(this);
  private _poll: Poll;
  private _asked = 0;
  private _shown = 0;
  private _snapshot = '';
  /** Operations whose end has been told: later events or answers about them are old news. */
  private _finished = new Set<string>();
  /** Drain operation id -> its children's operation ids. */
  private _drainChildren = new Map<string, Set<string>>();
}

/** Where an operation is kept: its kernel's id, or "gpu:N" for a drain of GPU N. */
function keyOf(op: IOperation): string {
  return op.action === 'drain' ? `gpu:${op.gpu}` : op.kernel_id;
}

/** A finished operation in one sentence. */
export function describe(op: IOperation): string {
  const total = Object.values(op.timings ?? {}).reduce((a, b) => a + b, 0);
  const seconds = `${total.toFixed(2)} s`;
  const bytes = op.bytes ? ` (${humanBytes(op.bytes)})` : '';
  // A kernel on several GPUs moves them together: each of its GPUs, and where it went.
  const from = op.from_gpus?.length
    ? ` from GPUs ${op.from_gpus.join(', ')}`
    : typeof op.from_gpu === 'number'
      ? ` from GPU ${op.from_gpu}`
      : '';
  const to = op.to_gpus?.length ? `GPUs ${op.to_gpus.join(', ')}` : `GPU ${op.to_gpu}`;
  const onto = op.to_gpus?.length || typeof op.to_gpu === 'number' ? ` on ${to}` : '';
  // A busy kernel served it at its running cell's safe point: the cell waited, then went on.
  const midCell =
    op.stash?.safe_point !== undefined || op.fast_path?.seconds?.safe_point !== undefined
      ? ', in the middle of a running cell'
      : '';
  switch (op.action) {
    case 'migrate':
      return op.to_host
        ? `moved to host ${op.to_host} in ${seconds}${bytes}.`
        : `moved${from} to ${to} in ${seconds}${bytes}${midCell}.`;
    case 'suspend': {
      // "auto" took memory, which filled as the images were written: they went to disk instead (images_why
      // begins so: jupyter_gpumigrate/engine/images.py FILLED).
      const filled =
        op.images === 'disk' && op.images_why?.startsWith('memory filled')
          ? ' to disk (memory filled as its images were written)'
          : '';
      return `suspended${filled} in ${seconds}${bytes}${midCell}.`;
    }
    case 'resume': {
      const why = op.trigger === 'cell' ? ' (a cell was run)' : '';
      return `resumed${onto} in ${seconds}${why}.`;
    }
    case 'transplant': {
      // Honestly labelled: the objects went to a new process, and what could not go is named.
      const where = op.to_gpu === null || op.to_gpu === undefined ? 'the CPU' : `GPU ${op.to_gpu}`;
      const left = op.transplant?.left ?? [];
      const lost = left.length ? `; not carried: ${left.map(l => l.name).join(', ')}` : '';
      return `transplanted to ${where} in ${seconds}: ${op.transplant?.carried.length ?? 0} objects carried${lost}.`;
    }
    case 'back':
      return `went back to the process its transplant replaced, in ${seconds}.`;
    case 'discard':
      return `discarded: suspended longer than the server keeps kernels, ${humanBytes(op.bytes)} of images deleted.`;
    default:
      return `${op.action} done in ${seconds}.`;
  }
}

/** What an operation in flight does, in a few words. */
export function doing(op: IOperation, kernel?: IKernel): string {
  switch (op.action) {
    case 'suspend':
      return 'suspending';
    case 'resume':
      return op.trigger === 'cell' ? 'resuming (a cell was run)' : 'resuming';
    case 'migrate':
      if (op.to_host) {
        return op.to_host === kernel?.home ? 'bringing home' : `moving to host ${op.to_host}`;
      }
      return op.to_gpus?.length
        ? `moving to GPUs ${op.to_gpus.join(', ')}`
        : `moving to GPU ${op.to_gpu}`;
    case 'transplant':
      return op.to_gpu === null || op.to_gpu === undefined
        ? 'transplanting to the CPU'
        : `transplanting to GPU ${op.to_gpu}`;
    case 'back':
      return 'going back to the process its transplant replaced';
    default:
      return op.action;
  }
}
