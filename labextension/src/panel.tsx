// The sidebar panel: each GPU with its memory and kernels, kernels on no GPU, suspended kernels, kernels
// on other hosts; the actions (move, suspend, resume, bring home, drain) and the progress of operations
// in flight. React renders it, so an update changes only what changed: an open menu stays open and focus
// stays where it is.
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import { ReactWidget, refreshIcon, UseSignal } from '@jupyterlab/ui-components';
import * as React from 'react';

import { api, humanBytes, IGpu, IKernel, IOperation } from './api';
import type { TransplantRequest } from './contract';
import { gpuIcon } from './icon';
import { doing, GpuMigrateStore } from './store';

export class GpuMigratePanel extends ReactWidget {
  constructor(private readonly store: GpuMigrateStore) {
    super();
    this.id = 'jp-gpumigrate-panel';
    this.addClass('jp-gpumigrate-panel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPU kernels';
  }

  protected onAfterShow(): void {
    this.store.watched = true;
    void this.store.refresh();
  }

  protected onAfterHide(): void {
    this.store.watched = false;
  }

  protected render(): React.ReactElement {
    return (
      <UseSignal signal={this.store.changed}>{() => <PanelView store={this.store} />}</UseSignal>
    );
  }
}

interface IStoreProps {
  store: GpuMigrateStore;
}

function PanelView({ store }: IStoreProps): React.ReactElement {
  const onGpu = new Set(store.gpus.flatMap(g => g.kernels.map(k => k.id)));
  const local = store.kernels.filter(k => !k.remote);
  const remote = store.kernels.filter(k => k.remote);
  const suspended = local.filter(k => k.state === 'suspended');
  const imageBytes = suspended.reduce((n, k) => n + (k.image_bytes ?? 0), 0);
  const inMemory = suspended.filter(k => k.images === 'memory').length;
  const cpu = local.filter(k => k.state !== 'suspended' && !onGpu.has(k.id));
  return (
    <>
      <header className="jp-gpumigrate-header">
        <h2>GPU kernels</h2>
        <button
          type="button"
          className="jp-gpumigrate-icon-button"
          title="Refresh"
          aria-label="Refresh the GPU kernels panel"
          onClick={() => void store.refresh()}
        >
          <refreshIcon.react tag="span" height="16px" width="16px" />
        </button>
      </header>
      <div className="jp-gpumigrate-body">
        {store.errors.map(error => (
          <p key={error} className="jp-gpumigrate-error" role="alert">
            {error}
          </p>
        ))}
        {!store.loaded && !store.errors.length && <p className="jp-gpumigrate-note">Loading…</p>}
        {store.loaded && !store.gpus.length && !store.errors.length && (
          <p className="jp-gpumigrate-note">
            No NVIDIA GPU is visible to the server. Kernels can still be suspended and resumed.
          </p>
        )}
        {store.gpus.map(gpu => (
          <GpuSection key={gpu.uuid} store={store} gpu={gpu} />
        ))}
        <Group
          store={store}
          title="No GPU"
          className="jp-gpumigrate-cpu"
          kernels={cpu}
          empty="No kernel runs without a GPU."
        />
        <Group
          store={store}
          title="Suspended"
          className="jp-gpumigrate-suspended"
          kernels={suspended}
          empty="No kernel is suspended."
          total={
            suspended.length
              ? `${suspended.length} suspended: ${humanBytes(imageBytes)} of images` +
                (inMemory ? ` (${inMemory} in memory)` : ' on disk')
              : undefined
          }
        />
        {remote.length > 0 && (
          <Group
            store={store}
            title="On other hosts"
            className="jp-gpumigrate-remote"
            kernels={remote}
            empty=""
          />
        )}
      </div>
    </>
  );
}

function Group(props: {
  store: GpuMigrateStore;
  title: string;
  className: string;
  kernels: IKernel[];
  empty: string;
  /** One line under the kernels (the suspended ones' images on disk). */
  total?: string;
}): React.ReactElement {
  return (
    <section className={`jp-gpumigrate-group ${props.className}`} aria-label={props.title}>
      <div className="jp-gpumigrate-title">{props.title}</div>
      {!props.kernels.length && <div className="jp-gpumigrate-muted">{props.empty}</div>}
      {props.kernels.map(kernel => (
        <KernelRow key={kernel.id} store={props.store} kernel={kernel} />
      ))}
      {props.total && <div className="jp-gpumigrate-muted jp-gpumigrate-total">{props.total}</div>}
    </section>
  );
}

function GpuSection({ store, gpu }: IStoreProps & { gpu: IGpu }): React.ReactElement {
  const used = gpu.memory_total ? (100 * gpu.memory_used) / gpu.memory_total : 0;
  const key = `gpu:${gpu.index}`;
  const drain = store.operations.get(key);
  const pending = store.pending.get(key);
  const kernels = store.kernels.filter(k => gpu.kernels.some(g => g.id === k.id));
  const memory = `${humanBytes(gpu.memory_used)} of ${humanBytes(gpu.memory_total)} used`;
  return (
    <section
      className="jp-gpumigrate-gpu"
      data-gpu-index={gpu.index}
      aria-label={`GPU ${gpu.index}, ${gpu.name}`}
    >
      <div className="jp-gpumigrate-row">
        <span className="jp-gpumigrate-title" title={gpu.uuid}>
          GPU {gpu.index} · {gpu.name}
        </span>
        {gpu.utilization !== null && (
          <span className="jp-gpumigrate-muted">{gpu.utilization}% busy</span>
        )}
        <button
          type="button"
          className="jp-gpumigrate-button jp-gpumigrate-drain"
          aria-label={`Drain GPU ${gpu.index}: move its kernels to other GPUs`}
          title={
            kernels.length ? 'Move every kernel off this GPU' : 'No kernel of this server is here'
          }
          disabled={!kernels.length || !!drain || !!pending}
          onClick={() => void confirmDrain(store, gpu, kernels)}
        >
          {drain ? 'Draining…' : (pending ?? 'Drain')}
        </button>
      </div>
      <div
        className="jp-gpumigrate-bar"
        role="meter"
        aria-label={`GPU ${gpu.index} memory`}
        aria-valuemin={0}
        aria-valuemax={100}
        aria-valuenow={Math.round(used)}
        aria-valuetext={memory}
      >
        <div className="jp-gpumigrate-bar-fill" style={{ width: `${used.toFixed(1)}%` }} />
      </div>
      <div className="jp-gpumigrate-muted">
        {memory}
        {gpu.mig_enabled ? ' · MIG on' : ''}
      </div>
      {gpu.error && <div className="jp-gpumigrate-error">{gpu.error}</div>}
      {drain && <DrainProgress store={store} gpu={gpu} op={drain} />}
      {kernels.map(kernel => (
        <KernelRow key={kernel.id} store={store} kernel={kernel} />
      ))}
    </section>
  );
}

async function confirmDrain(store: GpuMigrateStore, gpu: IGpu, kernels: IKernel[]): Promise<void> {
  const names = kernels.map(k => store.label(k.id)).join(', ');
  const result = await showDialog({
    title: `Drain GPU ${gpu.index}?`,
    body:
      `Move ${kernels.length === 1 ? 'its kernel' : `its ${kernels.length} kernels`} (${names}) ` +
      `to other GPUs of the same model, one after the other, while they run. A kernel that cannot ` +
      `move keeps running on GPU ${gpu.index}.`,
    // Opt-in: where the driver cannot go, the kernel's objects go (a transplant), only if all of them carry.
    checkbox: {
      label: 'Transplant a kernel the driver cannot move',
      caption:
        'Where no GPU of its model can take it, its objects go into a new process on the GPU (any model) ' +
        'with the most room, or on the CPU: only a kernel whose objects all carry (a generator, a thread, a ' +
        'socket would not). It can go back to its process for a while (an hour by default).',
      checked: false
    },
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Drain' })]
  });
  if (result.button.accept) {
    const transplant = result.isChecked === true;
    await store.start(`gpu:${gpu.index}`, 'Draining…', () => api.drain(gpu.index, transplant));
  }
}

/**
 * A transplant to the CPU, or to a GPU of another model (where the driver cannot go), honestly labelled:
 * what would not carry is listed (the server's dry run) before anything is done, and what was shown is
 * what is accepted.
 */
async function confirmTransplant(
  store: GpuMigrateStore,
  kernel: IKernel,
  name: string,
  toGpu: number | null = null
): Promise<void> {
  const target: TransplantRequest = toGpu === null ? { to_cpu: true } : { to_gpu: toGpu };
  const gpu = store.gpus.find(g => g.index === toGpu);
  const where = toGpu === null ? 'the CPU' : `GPU ${toGpu}`;
  let survey;
  try {
    survey = await api.transplantSurvey(kernel.id, target);
  } catch (error) {
    Notification.error(`${name}: ${error instanceof Error ? error.message : String(error)}`, {
      autoClose: false
    });
    return;
  }
  const left = survey.left.map(r => r.name);
  const body = (
    <div className="jp-gpumigrate-transplant-survey">
      <p>
        {toGpu === null
          ? 'A new kernel process starts without a GPU'
          : `A new kernel process starts on GPU ${toGpu}${gpu ? ` (${gpu.name})` : ''}`}
        , and the notebook’s objects are carried into it: not the process (threads, open files,
        sockets and the state of libraries stay behind).
      </p>
      <p>
        Carries {survey.carries.length} names ({humanBytes(survey.bytes)} of data).
      </p>
      {survey.left.length > 0 && (
        <ul className="jp-gpumigrate-left">
          {survey.left.map(r => (
            <li key={r.name}>
              Not carried: <code>{r.name}</code> ({r.type}): {r.reason}
            </li>
          ))}
        </ul>
      )}
      {survey.notes.length > 0 && (
        <ul className="jp-gpumigrate-notes">
          {survey.notes.map(r => (
            <li key={r.name}>
              <code>{r.name}</code> {r.note}
            </li>
          ))}
        </ul>
      )}
    </div>
  );
  const result = await showDialog({
    title: `Transplant ${name} to ${where}?`,
    body,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Transplant' })]
  });
  if (result.button.accept) {
    await store.start(kernel.id, 'Transplanting…', () =>
      api.transplant(kernel.id, { ...target, accept_left: left })
    );
  }
}

/** Back to the process the last transplant replaced: what the kernel did since is lost, so it asks first. */
async function confirmBack(store: GpuMigrateStore, kernel: IKernel, name: string): Promise<void> {
  const until = kernel.back_until ? new Date(kernel.back_until).toLocaleTimeString() : '';
  const result = await showDialog({
    title: `Go back to ${name}'s process before its transplant?`,
    body: `That process is kept until ${until}. Everything the kernel did since the transplant is lost: variables, outputs held in memory, training steps.`,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Go back' })]
  });
  if (result.button.accept) {
    await store.start(kernel.id, 'Going back…', () => api.back(kernel.id));
  }
}

function DrainProgress(props: IStoreProps & { gpu: IGpu; op: IOperation }): React.ReactElement {
  const results = props.op.results ?? [];
  const seen = new Set(results.map(r => r.kernel_id));
  // Kernels still on the GPU that the drain has not reached yet count too.
  const total = results.length + props.gpu.kernels.filter(k => !seen.has(k.id)).length;
  const done = results.filter(r => r.status === 'succeeded' || r.status === 'failed').length;
  const moved = results.filter(r => r.status === 'succeeded').length;
  const label = `Draining GPU ${props.gpu.index}: ${moved} of ${total} moved`;
  return (
    <div className="jp-gpumigrate-op" data-operation-id={props.op.id}>
      <span>{label}</span>
      <progress max={Math.max(total, 1)} value={done} aria-label={label} />
    </div>
  );
}

function KernelRow({ store, kernel }: IStoreProps & { kernel: IKernel }): React.ReactElement {
  const path = store.notebooks.get(kernel.id);
  const name = path ? PathExt.basename(path) : '(no notebook)';
  const op = store.operations.get(kernel.id);
  // A kernel on several GPUs is listed under each; here, what it holds on each.
  const held = kernel.gpus.map(g => `${humanBytes(g.memory_used)} on GPU ${g.index}`).join(' + ');
  const was = kernel.suspended_on.map(g => g.index).join(' and ');
  const details = [
    kernel.name,
    kernel.id.slice(0, 8),
    held || null,
    kernel.state === 'suspended'
      ? `${humanBytes(kernel.image_bytes)} ${kernel.images === 'memory' ? 'in memory' : 'on disk'}`
      : null,
    kernel.state === 'suspended' && was
      ? `was on GPU${kernel.suspended_on.length > 1 ? 's' : ''} ${was}`
      : null,
    kernel.state,
    kernel.remote ? `on host ${kernel.host}` : null
  ].filter(Boolean);
  let body: React.ReactNode;
  if (op) {
    body = <Progress op={op} kernel={kernel} name={name} />;
  } else if (kernel.operation || kernel.state === 'migrating') {
    body = <div className="jp-gpumigrate-op">Being moved…</div>;
  } else if (kernel.state === 'broken') {
    // Its images given (image_bytes): whole, and no process of it runs, so a resume brings it back.
    body = (
      <>
        <div className="jp-gpumigrate-error jp-gpumigrate-why" role="alert">
          {kernel.broken_reason ?? 'A move failed and could not be undone: restart the kernel.'}
        </div>
        {kernel.image_bytes !== null && (
          <div className="jp-gpumigrate-actions">
            <ActionButton
              store={store}
              kernel={kernel}
              className="jp-gpumigrate-resume"
              label="Resume"
              doing="Resuming…"
              ariaLabel={`Resume ${name}`}
              begin={() => api.resume(kernel.id)}
            />
          </div>
        )}
      </>
    );
  } else if (!kernel.migratable) {
    body = (
      <div className="jp-gpumigrate-muted jp-gpumigrate-why">
        Not started by jupyter-gpumigrate’s provisioner: restart the kernel to suspend or move it.
      </div>
    );
  } else {
    body = <Actions store={store} kernel={kernel} name={name} />;
  }
  return (
    <div className="jp-gpumigrate-kernel" data-kernel-id={kernel.id} data-state={kernel.state}>
      <div className="jp-gpumigrate-kernel-name" title={path ?? kernel.id}>
        {name}
      </div>
      <div className="jp-gpumigrate-muted jp-gpumigrate-details">{details.join(' · ')}</div>
      {body}
    </div>
  );
}

function ActionButton(props: {
  store: GpuMigrateStore;
  kernel: IKernel;
  className: string;
  label: string;
  doing: string;
  ariaLabel: string;
  begin: () => Promise<IOperation>;
}): React.ReactElement {
  const pending = props.store.pending.get(props.kernel.id);
  return (
    <button
      type="button"
      className={`jp-gpumigrate-button ${props.className}`}
      aria-label={props.ariaLabel}
      disabled={!!pending}
      onClick={() => void props.store.start(props.kernel.id, props.doing, props.begin)}
    >
      {pending === props.doing ? props.doing : props.label}
    </button>
  );
}

function Actions(props: IStoreProps & { kernel: IKernel; name: string }): React.ReactElement {
  const { store, kernel, name } = props;
  const id = kernel.id;
  const [choice, setChoice] = React.useState('');
  const [transplantChoice, setTransplantChoice] = React.useState('');
  const common = { store, kernel };
  if (kernel.remote) {
    return (
      <div className="jp-gpumigrate-actions">
        <ActionButton
          {...common}
          className="jp-gpumigrate-home"
          label="Bring home"
          doing="Bringing home…"
          ariaLabel={`Bring ${name} home to ${kernel.home}`}
          begin={() => api.moveToHost(id, kernel.home)}
        />
      </div>
    );
  }
  const here = new Set(kernel.gpus.map(g => g.index));
  const ok = kernel.targets.filter(t => t.ok);
  const refused = kernel.targets.filter(t => !t.ok && !here.has(t.index));
  const reasons = refused.map(t => `GPU ${t.index}: ${t.reason}`).join('\n');
  const pending = !!store.pending.get(id);
  // Where only a transplant goes: the GPUs of another model than the kernel's (any GPU, for a CPU kernel).
  const models = new Set(kernel.gpus.map(g => store.gpus.find(x => x.index === g.index)?.name));
  const elsewhere = store.gpus.filter(g => !models.has(g.name));
  const transplantTo = elsewhere.some(g => String(g.index) === transplantChoice)
    ? transplantChoice
    : String(elsewhere[0]?.index ?? '');
  if (kernel.state === 'running') {
    const value = ok.some(t => String(t.index) === choice) ? choice : String(ok[0]?.index ?? '');
    return (
      <>
        <div className="jp-gpumigrate-actions">
          {ok.length > 0 && (
            <>
              <TargetSelect
                className="jp-gpumigrate-move-to"
                label={`GPU to move ${name} to`}
                reasons={reasons}
                value={value}
                disabled={pending}
                targets={ok}
                onChange={setChoice}
              />
              <ActionButton
                {...common}
                className="jp-gpumigrate-move"
                label="Move"
                doing="Moving…"
                ariaLabel={`Move ${name} to the GPU chosen`}
                begin={() => api.moveToGpu(id, Number(value))}
              />
            </>
          )}
          <ActionButton
            {...common}
            className="jp-gpumigrate-suspend"
            label="Suspend"
            doing="Suspending…"
            ariaLabel={`Suspend ${name}`}
            begin={() => api.suspend(id)}
          />
          {kernel.gpus.length > 0 && (
            <button
              type="button"
              className="jp-gpumigrate-button jp-gpumigrate-to-cpu"
              aria-label={`Transplant ${name} to the CPU`}
              title="Carry the notebook's objects into a new kernel without a GPU (asks first)"
              disabled={pending}
              onClick={() => void confirmTransplant(store, kernel, name)}
            >
              To CPU…
            </button>
          )}
          {elsewhere.length > 0 && (
            <>
              <TargetSelect
                className="jp-gpumigrate-transplant-to"
                label={`GPU of another model to transplant ${name} to`}
                reasons="The driver cannot move a kernel to another GPU model: its objects are carried instead"
                value={transplantTo}
                disabled={pending}
                targets={elsewhere}
                onChange={setTransplantChoice}
              />
              <button
                type="button"
                className="jp-gpumigrate-button jp-gpumigrate-to-gpu"
                aria-label={`Transplant ${name} to the GPU of another model chosen`}
                title="Carry the notebook's objects into a new kernel on that GPU (asks first)"
                disabled={pending}
                onClick={() => void confirmTransplant(store, kernel, name, Number(transplantTo))}
              >
                To GPU…
              </button>
            </>
          )}
          {kernel.back_until && (
            <button
              type="button"
              className="jp-gpumigrate-button jp-gpumigrate-back"
              aria-label={`Go back to ${name}'s process before its transplant`}
              title="Go back to the process the transplant replaced, losing what the kernel did since (asks first)"
              disabled={pending}
              onClick={() => void confirmBack(store, kernel, name)}
            >
              Back…
            </button>
          )}
        </div>
        {kernel.gpus.length > 0 && !ok.length && (
          <div className="jp-gpumigrate-muted jp-gpumigrate-why">
            {refused.length ? `Cannot move: ${reasons}` : 'No other GPU to move it to.'}
          </div>
        )}
      </>
    );
  }
  // Suspended: resume where it was (the server's choice), or on a GPU that can take it.
  const value = ok.some(t => String(t.index) === choice) ? choice : '';
  return (
    <>
      <div className="jp-gpumigrate-actions">
        {ok.length > 0 && (
          <TargetSelect
            className="jp-gpumigrate-resume-on"
            label={`GPU to resume ${name} on`}
            reasons={reasons}
            value={value}
            disabled={pending}
            targets={ok}
            onChange={setChoice}
            first="where it was"
          />
        )}
        <ActionButton
          {...common}
          className="jp-gpumigrate-resume"
          label="Resume"
          doing="Resuming…"
          ariaLabel={`Resume ${name}`}
          begin={() => api.resume(id, value === '' ? undefined : Number(value))}
        />
      </div>
      {kernel.targets.length > 0 && !ok.length && (
        <div className="jp-gpumigrate-muted jp-gpumigrate-why">
          No GPU can take it now:{' '}
          {kernel.targets.map(t => `GPU ${t.index}: ${t.reason}`).join('\n')}
        </div>
      )}
    </>
  );
}

/** A choice among the GPUs that can take a kernel; the others' reasons in its tooltip. */
function TargetSelect(props: {
  className: string;
  label: string;
  reasons: string;
  value: string;
  disabled: boolean;
  targets: { index: number }[];
  onChange: (value: string) => void;
  first?: string;
}): React.ReactElement {
  return (
    <select
      className={`jp-gpumigrate-select ${props.className}`}
      aria-label={props.label}
      title={props.reasons}
      value={props.value}
      disabled={props.disabled}
      onChange={event => props.onChange(event.target.value)}
    >
      {props.first !== undefined && <option value="">{props.first}</option>}
      {props.targets.map(t => (
        <option key={t.index} value={t.index}>
          GPU {t.index}
        </option>
      ))}
    </select>
  );
}

function Progress(props: { op: IOperation; kernel: IKernel; name: string }): React.ReactElement {
  const { op, kernel } = props;
  // The phases of the operation's plan, in order, as the server lists them (a phase that does not
  // apply, such as the GPU phases of a CPU kernel, is skipped: the bar jumps past it). An operation
  // known only from its events so far has none yet: the next refresh fetches it whole.
  const phases: string[] = op.phases ?? [];
  const at = op.phase ? phases.indexOf(op.phase) + 1 : 0;
  const bytes = op.bytes ? ` · ${humanBytes(op.bytes)}` : '';
  const label = `${doing(op, kernel)}: ${op.phase ?? 'starting'}…${bytes}`;
  return (
    <div className="jp-gpumigrate-op" data-operation-id={op.id}>
      <span>{label}</span>
      <progress
        max={Math.max(phases.length, 1)}
        value={Math.max(at, 0)}
        aria-label={`${props.name}: ${label}`}
        aria-valuetext={at > 0 ? `phase ${at} of ${phases.length}: ${op.phase}` : label}
      />
    </div>
  );
}
