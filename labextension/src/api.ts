// The server's /api/gpumigrate, typed as the Python side answers it (jupyter_gpumigrate/operations.py).
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IGpuHeld {
  index: number;
  uuid: string;
  memory_used: number;
  name?: string;
}

/** Whether a kernel can go to one GPU now (a live move if it runs, a resume if it is suspended). */
export interface ITarget {
  index: number;
  ok: boolean;
  /** The server's sentence saying why not. */
  reason: string | null;
}

export interface IKernel {
  id: string;
  name: string;
  pid: number | null;
  host: string;
  /** The server that owns the kernel; `host` differs from it while the kernel runs on a peer. */
  home: string;
  /** It runs on the peer `host`; it comes back with a move to `home`. */
  remote: boolean;
  state: 'running' | 'migrating' | 'suspended';
  execution_state: string | null;
  last_activity: string | null;
  gpus: IGpuHeld[];
  image_bytes: number | null;
  suspended_on: IGpuHeld[];
  migratable: boolean;
  /** Id of the operation in flight, or null. */
  operation: string | null;
  /** One entry per GPU; empty for CPU and remote kernels, kernels being moved, or no GPUs. */
  targets: ITarget[];
}

export interface IGpu {
  index: number;
  uuid: string;
  name: string;
  memory_total: number;
  memory_used: number;
  utilization: number | null;
  mig_enabled: boolean;
  /** NVML's error when this GPU does not answer; such a GPU is listed, never chosen. */
  error?: string | null;
  kernels: { id: string; memory_used: number }[];
}

export interface IGpuList {
  driver_version: string | null;
  gpus: IGpu[];
}

export type Action = 'suspend' | 'resume' | 'migrate';
export type Status = 'pending' | 'running' | 'succeeded' | 'failed';

/** What became of one kernel of a drained GPU. */
export interface IDrainResult {
  kernel_id: string;
  status: Status;
  operation?: string;
  to_gpu?: number;
  error?: string;
}

export interface IOperation {
  id: string;
  kernel_id: string;
  action: Action | 'drain';
  status: Status;
  phase: string | null;
  error: string | null;
  timings: Record<string, number>;
  bytes: number;
  to_gpu: number | null;
  from_gpu: number | null;
  to_host?: string | null;
  from_host?: string | null;
  gpu: number | null;
  children?: string[];
  results?: IDrainResult[];
  /** "cell": a resume started by a cell run on the suspended kernel. */
  trigger?: 'api' | 'cell';
  version: number;
}

/** The schema of the server's operation events (jupyter_gpumigrate/event_schemas/operation/v1.yaml). */
export const EVENT_SCHEMA_ID = 'https://events.jupyter.org/jupyter_gpumigrate/operation/v1';

/** An error whose message is the server's own sentence, saying what to do. */
export class ApiError extends Error {}

export async function request<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'api/gpumigrate', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(`The Jupyter server does not answer: ${String(error)}`);
  }
  const text = await response.text();
  let data: { message?: string } | null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // An HTML page: jupyter_server's own 404 when this extension's handlers are not loaded.
    throw new ApiError(
      `The server answered ${response.status} ${response.statusText} with no JSON to ${path}: ` +
        'is the jupyter_gpumigrate server extension enabled? (jupyter server extension list)'
    );
  }
  if (!response.ok) {
    throw new ApiError(data?.message || `${response.status} ${response.statusText}`);
  }
  return data as T;
}

function post<T>(path: string, body: object = {}): Promise<T> {
  return request<T>(path, { method: 'POST', body: JSON.stringify(body) });
}

export const api = {
  kernels: () => request<IKernel[]>('kernels'),
  gpus: () => request<IGpuList>('gpus'),
  operations: () => request<IOperation[]>('operations'),
  operation: (id: string) => request<IOperation>(`operations/${id}`),
  suspend: (kernelId: string) => post<IOperation>(`kernels/${kernelId}/suspend`),
  resume: (kernelId: string, toGpu?: number) =>
    post<IOperation>(`kernels/${kernelId}/resume`, toGpu === undefined ? {} : { to_gpu: toGpu }),
  moveToGpu: (kernelId: string, toGpu: number) =>
    post<IOperation>(`kernels/${kernelId}/migrate`, { to_gpu: toGpu }),
  moveToHost: (kernelId: string, toHost: string) =>
    post<IOperation>(`kernels/${kernelId}/migrate`, { to_host: toHost }),
  drain: (index: number) => post<IOperation>(`gpus/${index}/drain`)
};

/** Bytes as people read them. */
export function humanBytes(n: number | null | undefined): string {
  if (!n) {
    return '0 B';
  }
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let value = n;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit++;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}
