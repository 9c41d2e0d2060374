// The sidebar panel: each GPU with its memory and kernels, kernels on no GPU, suspended kernels; and
// the actions (move, suspend, resume, drain) with the progress of operations in flight.
import { PathExt } from '@jupyterlab/coreutils';
import { refreshIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { api, humanBytes, IGpu, IGpuHeld, IKernel, IOperation } from './api';
import { gpuIcon } from './icon';
import { GpuMigrateStore } from './store';

/** Room kept free on a target beyond what a kernel holds (as the server's placement.HEADROOM). */
const HEADROOM = 512 * 1024 ** 2;

const PHASES: Record<string, string[]> = {
  migrate: ['prepare', 'stash', 'lock', 'checkpoint', 'remap', 'unlock', 'unstash', 'verify'],
  suspend: ['prepare', 'lock', 'checkpoint', 'dump'],
  resume: ['prepare', 'restore', 'remap', 'unlock', 'adopt'],
  drain: ['drain']
};

type Child = Node | string | null | undefined | false;

function h(tag: string, props: Record<string, string> = {}, ...children: Child[]): HTMLElement {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child) {
      node.append(child);
    }
  }
  return node;
}

function button(label: string, cls: string, onClick: () => void, disabled = false): HTMLElement {
  const node = h('button', { class: `jp-gpumigrate-button ${cls}`, type: 'button' }, label);
  (node as HTMLButtonElement).disabled = disabled;
  node.addEventListener('click', onClick);
  return node;
}

function free(gpu: IGpu): number {
  return gpu.memory_total - gpu.memory_used;
}

/** The GPUs that can take a kernel holding ``held`` (same model, MIG off, room), not its own. */
export function targetsFor(gpus: IGpu[], held: IGpuHeld, excludeOwn: boolean): IGpu[] {
  const model = held.name ?? gpus.find(g => g.uuid === held.uuid)?.name;
  return gpus.filter(
    g =>
      !(excludeOwn && g.uuid === held.uuid) &&
      g.name === model &&
      !g.mig_enabled &&
      free(g) >= held.memory_used + HEADROOM
  );
}

export class GpuMigratePanel extends Widget {
  constructor(private readonly store: GpuMigrateStore) {
    super();
    this.id = 'jp-gpumigrate-panel';
    this.addClass('jp-gpumigrate-panel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPU kernels';
    store.changed.connect(() => this.render(), this);
    this.render();
  }

  render(): void {
    const { store } = this;
    const header = h(
      'header',
      { class: 'jp-gpumigrate-header' },
      h('h2', {}, 'GPU kernels'),
      (() => {
        const refresh = h('button', {
          class: 'jp-gpumigrate-icon-button',
          title: 'Refresh',
          'aria-label': 'Refresh'
        });
        refreshIcon.element({ container: refresh, tag: null, height: '16px', width: '16px' });
        refresh.addEventListener('click', () => void store.refresh());
        return refresh;
      })()
    );
    const body = h('div', { class: 'jp-gpumigrate-body' });
    if (store.error) {
      body.append(h('p', { class: 'jp-gpumigrate-error' }, store.error));
    }
    if (!store.gpus.length) {
      body.append(
        h(
          'p',
          { class: 'jp-gpumigrate-note' },
          'No NVIDIA GPU is visible to the server. Kernels can still be suspended and resumed.'
        )
      );
    }
    for (const gpu of store.gpus) {
      body.append(this.gpuSection(gpu));
    }
    const onGpu = new Set(store.gpus.flatMap(g => g.kernels.map(k => k.id)));
    const cpu = store.kernels.filter(k => k.state !== 'suspended' && !onGpu.has(k.id));
    const suspended = store.kernels.filter(k => k.state === 'suspended');
    body.append(this.group('No GPU', 'jp-gpumigrate-cpu', cpu, 'No kernel runs without a GPU.'));
    body.append(
      this.group('Suspended', 'jp-gpumigrate-suspended', suspended, 'No kernel is suspended.')
    );
    this.node.replaceChildren(header, body);
  }

  private gpuSection(gpu: IGpu): HTMLElement {
    const used = gpu.memory_total ? (100 * gpu.memory_used) / gpu.memory_total : 0;
    const drainOp = this.store.operations.get(`gpu:${gpu.index}`);
    const kernels = this.store.kernels.filter(k => gpu.kernels.some(g => g.id === k.id));
    return h(
      'section',
      { class: 'jp-gpumigrate-gpu', 'data-gpu-index': String(gpu.index) },
      h(
        'div',
        { class: 'jp-gpumigrate-row' },
        h(
          'span',
          { class: 'jp-gpumigrate-title', title: gpu.uuid },
          `GPU ${gpu.index} · ${gpu.name}`
        ),
        h(
          'span',
          { class: 'jp-gpumigrate-muted' },
          gpu.utilization === null ? '' : `${gpu.utilization}% busy`
        ),
        button(
          drainOp ? 'Draining…' : 'Drain',
          'jp-gpumigrate-drain',
          () =>
            void this.store.start(
              `gpu:${gpu.index}`,
              () => api.drain(gpu.index),
              `Drain GPU ${gpu.index}`
            ),
          !kernels.length || !!drainOp
        )
      ),
      h(
        'div',
        {
          class: 'jp-gpumigrate-bar',
          role: 'meter',
          'aria-valuenow': used.toFixed(0),
          'aria-label': `GPU ${gpu.index} memory`
        },
        h('div', { class: 'jp-gpumigrate-bar-fill', style: `width: ${used.toFixed(1)}%` })
      ),
      h(
        'div',
        { class: 'jp-gpumigrate-muted' },
        `${humanBytes(gpu.memory_used)} of ${humanBytes(gpu.memory_total)} used`
      ),
      ...kernels.map(k => this.kernelRow(k))
    );
  }

  private group(title: string, cls: string, kernels: IKernel[], empty: string): HTMLElement {
    return h(
      'section',
      { class: `jp-gpumigrate-group ${cls}` },
      h('div', { class: 'jp-gpumigrate-title' }, title),
      kernels.length ? null : h('div', { class: 'jp-gpumigrate-muted' }, empty),
      ...kernels.map(k => this.kernelRow(k))
    );
  }

  private kernelRow(kernel: IKernel): HTMLElement {
    const { store } = this;
    const path = store.notebooks.get(kernel.id);
    const op = store.operations.get(kernel.id);
    const held = kernel.gpus[0];
    const details = [
      kernel.name,
      kernel.id.slice(0, 8),
      held ? humanBytes(held.memory_used) : null,
      kernel.state === 'suspended' ? `${humanBytes(kernel.image_bytes)} on disk` : null,
      kernel.state,
      kernel.remote ? `on host ${kernel.host}` : null
    ].filter(Boolean);
    const row = h(
      'div',
      { class: 'jp-gpumigrate-kernel', 'data-kernel-id': kernel.id, 'data-state': kernel.state },
      h(
        'div',
        { class: 'jp-gpumigrate-kernel-name', title: path ?? kernel.id },
        path ? PathExt.basename(path) : '(no notebook)'
      ),
      h('div', { class: 'jp-gpumigrate-muted jp-gpumigrate-details' }, details.join(' · '))
    );
    if (op) {
      row.append(this.progress(op));
    } else if (kernel.migratable && !kernel.remote) {
      // A kernel on a peer host comes back with %migrate --to-host or the CLI first.
      row.append(this.actions(kernel, held));
    }
    return row;
  }

  private actions(kernel: IKernel, held: IGpuHeld | undefined): HTMLElement {
    const { store } = this;
    const start = (action: 'suspend' | 'resume' | 'migrate', toGpu?: number) =>
      void store.start(
        kernel.id,
        () => api.act(kernel.id, action, toGpu),
        `${action} ${kernel.id.slice(0, 8)}`
      );
    const box = h('div', { class: 'jp-gpumigrate-actions' });
    if (kernel.state === 'running') {
      if (held) {
        const targets = targetsFor(store.gpus, held, true);
        const select = this.select(`move:${kernel.id}`, targets, null, 'Move to');
        box.append(
          select,
          button(
            'Move',
            'jp-gpumigrate-move',
            () => start('migrate', Number(select.value)),
            !targets.length
          )
        );
      }
      box.append(button('Suspend', 'jp-gpumigrate-suspend', () => start('suspend')));
    } else if (kernel.state === 'suspended') {
      const was = kernel.suspended_on[0];
      if (was && store.gpus.length) {
        const select = this.select(
          `resume:${kernel.id}`,
          targetsFor(store.gpus, was, false),
          'where it was',
          'Resume on'
        );
        box.append(select);
        box.append(
          button('Resume', 'jp-gpumigrate-resume', () =>
            start('resume', select.value === '' ? undefined : Number(select.value))
          )
        );
      } else {
        box.append(button('Resume', 'jp-gpumigrate-resume', () => start('resume')));
      }
    }
    return box;
  }

  private select(
    key: string,
    gpus: IGpu[],
    defaultLabel: string | null,
    label: string
  ): HTMLSelectElement {
    const select = h('select', {
      class: 'jp-gpumigrate-select',
      'aria-label': label
    }) as HTMLSelectElement;
    // Re-rendering (events, the timer) must not undo a choice: remember it per kernel.
    select.addEventListener('change', () => this._choices.set(key, select.value));
    if (defaultLabel) {
      select.append(h('option', { value: '' }, defaultLabel));
    }
    for (const gpu of gpus) {
      select.append(
        h(
          'option',
          { value: String(gpu.index) },
          `GPU ${gpu.index} (${humanBytes(free(gpu))} free)`
        )
      );
    }
    if (!gpus.length && !defaultLabel) {
      select.append(h('option', { value: '' }, 'no GPU can take it'));
      select.disabled = true;
    }
    const chosen = this._choices.get(key);
    if (chosen !== undefined && Array.from(select.options).some(o => o.value === chosen)) {
      select.value = chosen;
    }
    return select;
  }

  private progress(op: IOperation): HTMLElement {
    const phases = PHASES[op.action] ?? [];
    const at = op.phase ? phases.indexOf(op.phase) + 1 : 0;
    const label = op.phase ? `${op.action}: ${op.phase}…` : `${op.action}: starting…`;
    const bar = h('progress', { class: 'jp-gpumigrate-progress', max: String(phases.length || 1) });
    (bar as HTMLProgressElement).value = at;
    return h(
      'div',
      { class: 'jp-gpumigrate-op', 'data-operation-id': op.id },
      h('span', {}, label),
      bar
    );
  }
  private _choices = new Map<string, string>();
}
