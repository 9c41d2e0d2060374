// The server's /api/gpumigrate. Its bodies' types are generated from the API's JSON Schema
// (client/jupyter_gpumigrate_client/contract/api.schema.json) into ./contract.ts by `npm run gen:types`; the names
// below are what the panel calls them.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import type {
  Action as AnyAction,
  DrainRequest,
  DrainResult,
  ErrorBody,
  Gpu,
  GpuList,
  HeldGpu,
  Kernel,
  KernelList,
  MigrateRequest,
  Operation,
  OperationList,
  OperationStatus,
  ResumeRequest,
  SuspendRequest,
  Target,
  TransplantRequest,
  BackRequest,
  TransplantSurvey
} from './contract';

export type { Phase } from './contract';

export type IGpuHeld = HeldGpu;
/** Whether a kernel can go to one GPU now (a live move if it runs, a resume if it is suspended). */
export type ITarget = Target;
export type IKernel = Kernel;
export type IGpu = Gpu;
export type IGpuList = GpuList;
/** What a kernel's own action does (a drain is a GPU's). */
export type Action = Exclude<AnyAction, 'drain'>;
export type Status = OperationStatus;
/** What became of one kernel of a drained GPU. */
export type IDrainResult = DrainResult;
export type IOperation = Operation;

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
  let data: Partial<ErrorBody> | null;
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

/** A POST whose body is of the schema's type `B`, answered 202 with the operation it started. */
function start<B extends object>(path: string, body: B): Promise<Operation> {
  return request<Operation>(path, { method: 'POST', body: JSON.stringify(body) });
}

export const api = {
  kernels: () => request<KernelList>('kernels'),
  gpus: () => request<GpuList>('gpus'),
  operations: () => request<OperationList>('operations'),
  operation: (id: string) => request<Operation>(`operations/${id}`),
  suspend: (kernelId: string) => start<SuspendRequest>(`kernels/${kernelId}/suspend`, {}),
  resume: (kernelId: string, toGpu?: number) =>
    start<ResumeRequest>(
      `kernels/${kernelId}/resume`,
      toGpu === undefined ? {} : { to_gpu: toGpu }
    ),
  moveToGpu: (kernelId: string, toGpu: number) =>
    start<MigrateRequest>(`kernels/${kernelId}/migrate`, { to_gpu: toGpu }),
  moveToHost: (kernelId: string, toHost: string) =>
    start<MigrateRequest>(`kernels/${kernelId}/migrate`, { to_host: toHost }),
  /** `transplant`: a kernel the driver cannot move is transplanted instead, where everything of it carries. */
  drain: (index: number, transplant = false) =>
    start<DrainRequest>(`gpus/${index}/drain`, transplant ? { transplant: true } : {}),
  /** What a transplant would carry and what not (its dry run: nothing is done). */
  transplantSurvey: (kernelId: string, body: TransplantRequest) =>
    request<TransplantSurvey>(`kernels/${kernelId}/transplant`, {
      method: 'POST',
      body: JSON.stringify({ ...body, dry_run: true })
    }),
  transplant: (kernelId: string, body: TransplantRequest) =>
    start<TransplantRequest>(`kernels/${kernelId}/transplant`, body),
  /** Back to the process the kernel's last transplant replaced (what it did since is lost). */
  back: (kernelId: string) => start<BackRequest>(`kernels/${kernelId}/back`, {})
};

/** Powers of 1000, largest first. */
const UNITS: [number, string][] = [
  [1e12, 'TB'],
  [1e9, 'GB'],
  [1e6, 'MB'],
  [1e3, 'KB']
];

/**
 * Bytes as people read them, in powers of 1000 (1 GB = 10^9 bytes): the same words as the CLI, %migrate
 * and the Hub print for the same operation (jupyter_gpumigrate/opformat.py: size).
 */
export function humanBytes(n: number | null | undefined): string {
  if (!n) {
    return '0 B';
  }
  for (const [unit, name] of UNITS) {
    // From where the unit below would round up to 1000 (999.95 MB is 1.0 GB; 999.5 B is 1.0 KB).
    if (Math.abs(n) >= unit * (unit === 1e3 ? 0.9995 : 0.99995)) {
      return `${(n / unit).toFixed(1)} ${name}`;
    }
  }
  return `${n.toFixed(0)} B`;
}
