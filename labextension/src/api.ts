// The server's /api/gpumigrate, typed as the Python side answers it (jupyter_gpumigrate/operations.py).
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IGpuHeld {
  index: number;
  uuid: string;
  memory_used: number;
  name?: string;
}

export interface IKernel {
  id: string;
  name: string;
  pid: number | null;
  host: string;
  /** The server that owns the kernel; `host` differs from it while the kernel runs on a peer. */
  home?: string;
  remote?: boolean;
  state: 'running' | 'migrating' | 'suspended' | 'stopped';
  execution_state: string | null;
  gpus: IGpuHeld[];
  image_bytes: number | null;
  suspended_on: IGpuHeld[];
  migratable: boolean;
  operation: string | null;
}

export interface IGpu {
  index: number;
  uuid: string;
  name: string;
  memory_total: number;
  memory_used: number;
  utilization: number | null;
  mig_enabled: boolean;
  kernels: { id: string; memory_used: number }[];
}

export interface IOperation {
  id: string;
  kernel_id: string;
  action: 'suspend' | 'resume' | 'migrate' | 'drain';
  status: 'pending' | 'running' | 'succeeded' | 'failed';
  phase: string | null;
  error: string | null;
  timings: Record<string, number>;
  total: number;
  bytes: number;
  to_gpu: number | null;
  from_gpu: number | null;
  gpu: number | null;
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
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    throw new ApiError(data?.message ?? `${response.status} ${response.statusText}`);
  }
  return data as T;
}

export const api = {
  kernels: () => request<IKernel[]>('kernels'),
  gpus: () => request<{ driver_version: string | null; gpus: IGpu[] }>('gpus'),
  operation: (id: string) => request<IOperation>(`operations/${id}`),
  act: (kernelId: string, action: 'suspend' | 'resume' | 'migrate', toGpu?: number) =>
    request<IOperation>(`kernels/${kernelId}/${action}`, {
      method: 'POST',
      body: JSON.stringify(toGpu === undefined ? {} : { to_gpu: toGpu })
    }),
  drain: (index: number) =>
    request<IOperation>(`gpus/${index}/drain`, { method: 'POST', body: '{}' })
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
