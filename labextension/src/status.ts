// The status bar item of the notebook in front: the GPU its kernel is on, "suspended", "CPU", or the
// operation under way. A click opens the panel.
import { INotebookTracker } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { GpuMigrateStore } from './store';

export class KernelGpuStatus extends Widget {
  constructor(
    private readonly store: GpuMigrateStore,
    private readonly notebooks: INotebookTracker,
    onClick: () => void
  ) {
    super();
    this.addClass('jp-gpumigrate-status');
    this.node.title =
      'Where this notebook’s kernel runs (jupyter-gpumigrate): click to open the panel';
    this.node.addEventListener('click', onClick);
    store.changed.connect(() => this.update(), this);
    notebooks.currentChanged.connect((_, panel) => {
      panel?.sessionContext.kernelChanged.connect(() => this.update(), this);
      this.update();
    }, this);
    this.update();
  }

  protected onUpdateRequest(): void {
    this.node.textContent = this.label();
  }

  private label(): string {
    const id = this.notebooks.currentWidget?.sessionContext.session?.kernel?.id;
    const kernel = this.store.kernel(id);
    if (!kernel) {
      return '';
    }
    const op = this.store.operations.get(kernel.id);
    if (op) {
      return `${op.action}: ${op.phase || 'starting'}…`;
    }
    if (kernel.state === 'suspended') {
      return 'Kernel suspended';
    }
    if (kernel.remote) {
      const gpu = kernel.gpus.length ? `, GPU ${kernel.gpus.map(g => g.index).join(', ')}` : '';
      return `On host ${kernel.host}${gpu}`;
    }
    const gpus = this.store.gpus.filter(g => g.kernels.some(k => k.id === kernel.id));
    return gpus.length ? `GPU ${gpus.map(g => g.index).join(', ')}` : 'CPU';
  }
}
