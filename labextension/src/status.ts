// The status bar item of the notebook in front: the GPU its kernel is on, "suspended", "CPU", or the
// operation under way. It is a button: a click, Enter or Space opens the panel.
import { INotebookTracker } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { doing, GpuMigrateStore } from './store';

export class KernelGpuStatus extends Widget {
  constructor(
    private readonly store: GpuMigrateStore,
    private readonly notebooks: INotebookTracker,
    onClick: () => void
  ) {
    super();
    this.addClass('jp-gpumigrate-status');
    this.node.setAttribute('role', 'button');
    this.node.tabIndex = 0;
    this.node.title = 'Where this notebook’s kernel runs (jupyter-gpumigrate): open the panel';
    this.node.addEventListener('click', onClick);
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        onClick();
      }
    });
    store.changed.connect(() => this.update(), this);
    notebooks.currentChanged.connect((_, panel) => {
      panel?.sessionContext.kernelChanged.connect(() => this.update(), this);
      this.update();
    }, this);
    this.update();
  }

  protected onUpdateRequest(): void {
    const label = this.label();
    if (this.node.textContent !== label) {
      this.node.textContent = label;
      this.node.setAttribute('aria-label', `${label || 'No kernel'}: open the GPU kernels panel`);
    }
  }

  private label(): string {
    const id = this.notebooks.currentWidget?.sessionContext.session?.kernel?.id;
    const kernel = this.store.kernel(id);
    if (!kernel) {
      return '';
    }
    const op = this.store.operations.get(kernel.id);
    if (op) {
      return `${doing(op, kernel)}: ${op.phase || 'starting'}…`;
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
