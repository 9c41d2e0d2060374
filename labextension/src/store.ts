// What the panel and the status bar show: kernels, GPUs, notebooks and running operations, kept fresh
// by the server's events (each phase of each operation) and a modest timer for GPU memory.
import { Notification } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { Event, ServiceManager } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { api, ApiError, EVENT_SCHEMA_ID, IGpu, IKernel, IOperation } from './api';

/** Seconds between refreshes when no event arrives (GPU memory and utilisation change without one). */
const REFRESH_MS = 5000;

export class GpuMigrateStore {
  constructor(
    private readonly services: ServiceManager.IManager,
    private readonly tracker: INotebookTracker | null = null
  ) {
    services.events.stream.connect(this._onEvent, this);
    this._timer = window.setInterval(() => void this.refresh(), REFRESH_MS);
    void this.refresh();
  }

  kernels: IKernel[] = [];
  gpus: IGpu[] = [];
  /** Kernel id -> notebook path, from the server's sessions. */
  notebooks = new Map<string, string>();
  /** Kernel id (or "gpu:N" for a drain) -> the operation in flight. */
  operations = new Map<string, IOperation>();
  error: string | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  kernel(id: string | undefined): IKernel | undefined {
    return this.kernels.find(k => k.id === id);
  }

  async refresh(): Promise<void> {
    try {
      const [kernels, gpus] = await Promise.all([api.kernels(), api.gpus()]);
      this.kernels = kernels;
      this.gpus = gpus.gpus;
      // The server is the truth: drop operations it no longer runs (their last event may have been lost
      // while the event stream reconnected, or arrived before the POST's reply).
      for (const [key, op] of this.operations) {
        const kernel = kernels.find(k => k.id === key);
        if (!key.startsWith('gpu:') && kernel?.operation !== op.id) {
          this.operations.delete(key);
        }
      }
      this.notebooks = new Map();
      for (const session of this.services.sessions.running()) {
        if (session.kernel) {
          this.notebooks.set(session.kernel.id, session.path);
        }
      }
      // What the user sees wins: an open notebook's own path (a session's lags behind some renames).
      this.tracker?.forEach(panel => {
        const id = panel.sessionContext.session?.kernel?.id;
        if (id) {
          this.notebooks.set(id, panel.context.path);
        }
      });
      this.error = null;
    } catch (error) {
      this.error = error instanceof ApiError ? error.message : String(error);
    }
    this._changed.emit();
  }

  /** Start an operation; its progress arrives as events, its failure as a notification. */
  async start(key: string, begin: () => Promise<IOperation>, what: string): Promise<void> {
    try {
      const op = await begin();
      const known = this.operations.get(key);
      // Events may have overtaken this reply: keep whichever is newer.
      if (!known || known.id !== op.id || known.version < op.version) {
        this.operations.set(key, op);
      }
      this._changed.emit();
      if (op.action === 'drain') {
        // A drain is followed by its children's events; forget it once its kernels have moved.
        window.setTimeout(() => {
          this.operations.delete(key);
          void this.refresh();
        }, 15000);
      }
    } catch (error) {
      Notification.error(`${what}: ${error instanceof Error ? error.message : String(error)}`, {
        autoClose: false
      });
    }
  }

  dispose(): void {
    window.clearInterval(this._timer);
    this.services.events.stream.disconnect(this._onEvent, this);
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    if (event.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const data = event as unknown as IOperation & { operation_id: string; phase_event: string };
    const key = data.action === 'drain' ? `gpu:${data.gpu}` : data.kernel_id;
    const known = this.operations.get(key);
    if (known && known.id !== data.operation_id) {
      return;
    }
    const op: IOperation = { ...(known as IOperation), ...data, id: data.operation_id };
    if (op.status === 'succeeded' || op.status === 'failed') {
      this.operations.delete(key);
      if (op.status === 'failed' && op.error) {
        Notification.error(`${op.action} failed: ${op.error}`, { autoClose: false });
      } else if (op.action !== 'drain') {
        Notification.success(describe(op), { autoClose: 5000 });
      }
      void this.refresh();
    } else {
      this.operations.set(key, op);
      this._changed.emit();
    }
  }

  private _changed = new Signal<this, void>(this);
  private _timer: number;
}

function describe(op: IOperation): string {
  const total = Object.values(op.timings ?? {}).reduce((a, b) => a + b, 0);
  const seconds = `${total.toFixed(2)} s`;
  switch (op.action) {
    case 'migrate':
      return `Moved to GPU ${op.to_gpu} in ${seconds}.`;
    case 'suspend':
      return `Suspended in ${seconds}.`;
    default:
      return `Resumed in ${seconds}.`;
  }
}
