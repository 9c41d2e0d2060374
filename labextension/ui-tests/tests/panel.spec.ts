// The panel in a real JupyterLab, a real server with jupyter-gpumigrate and real CRIU, in Debian's Chromium.
// One test ("rendering with GPUs") serves written-out GPU data instead: see there.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator, Request } from '@playwright/test';

// The server's bodies, as the API's schema describes them: written-out data cannot drift from it.
import type { Gpu, GpuList, Kernel } from '../../src/contract';

const SHOTS = 'test-results/screenshots';
/** The sidebar's width in the "default" screenshots, and the narrow width the layout must survive. */
const WIDE = 300;
const NARROW = 220;

/**
 * What overflows sideways in the panel: any element reaching past the panel's right edge, and any
 * element whose content is wider than its box, except text that is cut on purpose with an ellipsis.
 */
async function overflowing(panel: Locator): Promise<string[]> {
  return panel.evaluate(root => {
    const limit = root.getBoundingClientRect().right + 0.5;
    const name = (el: Element) => `${el.tagName.toLowerCase()}.${el.className}`;
    const found: string[] = [];
    if (root.scrollWidth > root.clientWidth + 1) {
      found.push(`${name(root)} (content wider than the panel)`);
    }
    for (const el of Array.from(root.querySelectorAll<HTMLElement>('*'))) {
      if (el.getBoundingClientRect().right > limit) {
        found.push(`${name(el)} (past the panel's edge)`);
      } else if (
        el.scrollWidth > el.clientWidth + 1 &&
        getComputedStyle(el).textOverflow !== 'ellipsis'
      ) {
        found.push(`${name(el)} (content wider than its box)`);
      }
    }
    return found;
  });
}

async function openPanel(page: IJupyterLabPageFixture): Promise<Locator> {
  await page.sidebar.openTab('jp-gpumigrate-panel');
  const panel = page.locator('#jp-gpumigrate-panel');
  await expect(panel).toBeVisible();
  return panel;
}

/** Let the sidebar be narrower than JupyterLab's themes allow (250px), to check the layout at NARROW. */
async function allowNarrowSidebar(page: IJupyterLabPageFixture): Promise<void> {
  await page.addStyleTag({ content: ':root { --jp-sidebar-min-width: 200px !important; }' });
}

async function setPanelWidth(page: IJupyterLabPageFixture, panel: Locator, width: number) {
  await page.sidebar.setWidth(width, 'left');
  const box = await panel.boundingBox();
  expect(Math.abs((box?.width ?? 0) - width)).toBeLessThanOrEqual(8);
}

/** The id of the kernel of the notebook in front. */
async function currentKernelId(page: IJupyterLabPageFixture): Promise<string> {
  let id = '';
  await expect
    .poll(async () => {
      id = await page.evaluate(() => {
        type Front = { sessionContext?: { session?: { kernel?: { id: string } | null } | null } };
        const app = (window as unknown as { galata: { app: { shell: { currentWidget: Front } } } })
          .galata.app;
        return app.shell.currentWidget?.sessionContext?.session?.kernel?.id ?? '';
      });
      return id;
    })
    .not.toEqual('');
  return id;
}

test('suspend and resume a kernel from the panel; the notebook goes on with its state', async ({
  page
}) => {
  await page.notebook.createNew('state.ipynb');
  await page.notebook.setCell(0, 'code', "secret = 'kept across suspend'; print('set')");
  await page.notebook.runCell(0);
  expect(await page.notebook.getCellTextOutput(0)).toEqual(['set\n']);

  const panel = await openPanel(page);
  const running = panel.locator('.jp-gpumigrate-cpu .jp-gpumigrate-kernel');
  await expect(running).toHaveCount(1);
  await expect(running).toHaveAttribute('data-state', 'running');
  await expect(running.locator('.jp-gpumigrate-kernel-name')).toHaveText('state.ipynb');
  await expect(panel.locator('.jp-gpumigrate-note')).toContainText('No NVIDIA GPU is visible');
  const status = page.locator('.jp-gpumigrate-status');
  await expect(status).toHaveText('CPU');
  await expect(status).toHaveAttribute('role', 'button');

  await running.getByRole('button', { name: 'Suspend state.ipynb' }).click();
  const suspended = panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel');
  await expect(suspended).toHaveAttribute('data-state', 'suspended');
  // The test server puts images in memory (jupyter_server_test_config.py): the panel says where they are.
  await expect(suspended.locator('.jp-gpumigrate-details')).toContainText('in memory');
  // Under the group, one line: how much the suspended kernels hold, and where.
  const total = panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-total');
  await expect(total).toHaveText(/^1 suspended: [\d.]+ [KMG]?B of images \(1 in memory\)$/);
  await expect(status).toHaveText('Kernel suspended');
  await panel.screenshot({ path: `${SHOTS}/panel-suspended-light.png` });

  await suspended.getByRole('button', { name: 'Resume state.ipynb' }).click();
  await expect(running).toHaveAttribute('data-state', 'running');
  await expect(panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel')).toHaveCount(0);
  await expect(total).toHaveCount(0);
  await expect(status).toHaveText('CPU');

  // The same tab, never reloaded, runs the next cell in the resumed kernel.
  await page.notebook.setCell(1, 'code', 'print(secret)');
  await page.notebook.runCell(1);
  expect(await page.notebook.getCellTextOutput(1)).toEqual(['kept across suspend\n']);
});

test('running a cell on a suspended kernel resumes it', async ({ page }) => {
  await page.notebook.createNew('autoresume.ipynb');
  await page.notebook.setCell(0, 'code', "before = 'set before the suspend'; print('set')");
  await page.notebook.runCell(0);
  expect(await page.notebook.getCellTextOutput(0)).toEqual(['set\n']);

  const panel = await openPanel(page);
  const row = panel.locator('.jp-gpumigrate-kernel');
  await expect(row).toHaveCount(1);
  await row.getByRole('button', { name: 'Suspend autoresume.ipynb' }).click();
  await expect(panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel')).toHaveAttribute(
    'data-state',
    'suspended'
  );

  // No click on Resume: the cell itself brings the kernel back.
  await page.notebook.setCell(1, 'code', 'print(before)');
  await page.notebook.runCell(1);
  expect(await page.notebook.getCellTextOutput(1)).toEqual(['set before the suspend\n']);
  await expect(panel.locator('.jp-gpumigrate-cpu .jp-gpumigrate-kernel')).toHaveAttribute(
    'data-state',
    'running'
  );
  await expect(page.locator('.jp-gpumigrate-status')).toHaveText('CPU');
  await expect(
    page.locator('.Toastify__toast').filter({ hasText: 'resumed in' }).first()
  ).toContainText('(a cell was run)');
});

test('the panel in light and dark themes, and at a narrow width', async ({ page }) => {
  await page.notebook.createNew('a-notebook-with-a-rather-long-name-for-a-narrow-sidebar.ipynb');
  await page.notebook.setCell(0, 'code', 'x = 1');
  await page.notebook.runCell(0);
  await allowNarrowSidebar(page);
  const panel = await openPanel(page);
  await expect(panel.locator('.jp-gpumigrate-kernel')).toHaveCount(1);
  await setPanelWidth(page, panel, WIDE);
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-light.png` });

  await setPanelWidth(page, panel, NARROW);
  await expect(panel.locator('.jp-gpumigrate-suspend')).toBeVisible();
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-narrow-light.png` });

  await page.theme.setDarkTheme();
  await setPanelWidth(page, panel, WIDE);
  await panel.screenshot({ path: `${SHOTS}/panel-dark.png` });
  await setPanelWidth(page, panel, NARROW);
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-narrow-dark.png` });
});

test('one click is one request; a refused action is a notification with the server’s sentence', async ({
  page
}) => {
  await page.notebook.createNew('refused.ipynb');
  const panel = await openPanel(page);
  const row = panel.locator('.jp-gpumigrate-kernel');
  await expect(row).toHaveCount(1);

  // Hold the panel's request while another client (this test, through the REST API) suspends the
  // kernel first: the server then refuses the panel's, in its own words.
  const posts: Request[] = [];
  let release: () => void = () => {};
  const released = new Promise<void>(resolve => (release = resolve));
  await page.route(/\/api\/gpumigrate\/kernels\/[^/]+\/suspend(\?.*)?$/, async route => {
    posts.push(route.request());
    await released;
    await route.continue();
  });
  const suspend = row.locator('.jp-gpumigrate-suspend');
  await suspend.click();
  await expect(suspend).toHaveText('Suspending…');
  await expect(suspend).toBeDisabled();
  await suspend.evaluate(el => (el as HTMLButtonElement).click()); // a second click does nothing
  const other = await page.request.post(posts[0].url(), { data: {} });
  expect(other.status()).toBe(202);
  release();

  await expect(
    page.locator('.Toastify__toast').filter({
      hasText:
        /refused\.ipynb: .*(already has an operation under way|is suspended, so it cannot be suspended)/
    })
  ).toBeVisible();
  await expect(panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel')).toHaveAttribute(
    'data-state',
    'suspended'
  );
  expect(posts).toHaveLength(1);
});

// A RENDERING test with server answers written out here: this machine has no GPU, so GET
// /api/gpumigrate/gpus and GET /api/gpumigrate/kernels are answered by the page.route handlers below,
// with data in exactly the shape the server sends (typed by the API's schema, which tests/test_contract.py
// checks against the live server; the refusal sentences are placement.py's). Everything else, the kernel included, is the real server. It shows
// how the panel draws GPUs; it tests no GPU behaviour: the GPU suite (tests/test_gpu.py) does that on
// real GPUs.
test('rendering with GPUs (written-out server data, no GPU here)', async ({ page }) => {
  await page.notebook.createNew('train.ipynb');
  const id = await currentKernelId(page);
  const H200 = 150_754_820_096; // 143771 MiB, as NVML reports an H200's memory
  const held = 8_589_934_592;
  let polls = 0;
  const gpu = (index: number, name: string, total: number, used: number, kernels: number): Gpu => ({
    index,
    uuid: `GPU-${index}a3b5c7d-1e2f-4a5b-8c9d-0e1f2a3b4c5${index}`,
    name,
    memory_total: total,
    // Changes a little at each poll, as real memory does: the panel must update in place.
    memory_used: used + polls * 1_048_576,
    utilization: kernels ? 37 : 0,
    persistence_mode: true,
    mig_enabled: false,
    processes: kernels ? [{ pid: 4242, memory_used: held }] : [],
    error: null,
    kernels: kernels ? [{ id, memory_used: held }] : []
  });
  await page.route(/\/api\/gpumigrate\/gpus(\?.*)?$/, route => {
    if (route.request().method() !== 'GET') {
      return route.fallback();
    }
    polls++;
    const json: GpuList = {
      driver_version: '580.159.04',
      host: 'gpu-node-1',
      gpus: [
        gpu(0, 'NVIDIA H200', H200, 9_193_914_368, 1),
        gpu(1, 'NVIDIA H200', H200, 566_231_040, 0),
        gpu(2, 'NVIDIA A100-SXM4-80GB', 85_899_345_920, 456_130_560, 0)
      ],
      peers: []
    };
    return route.fulfill({ json });
  });
  // Until when the real kernel's process before its transplant is kept (set once it is transplanted).
  let backUntil: string | null = null;
  await page.route(/\/api\/gpumigrate\/kernels(\?.*)?$/, route => {
    if (route.request().method() !== 'GET') {
      return route.fallback();
    }
    const json: Kernel[] = [
      {
        id,
        name: 'python3',
        pid: 4242,
        host: 'gpu-node-1',
        home: 'gpu-node-1',
        state: 'running',
        remote: false,
        broken_reason: null,
        execution_state: 'idle',
        last_activity: '2026-11-23T00:12:10.000000+00:00',
        gpus: [{ index: 0, uuid: 'GPU-0a3b5c7d-1e2f-4a5b-8c9d-0e1f2a3b4c50', memory_used: held }],
        image_bytes: null,
        images: null,
        suspended_on: [],
        migratable: true,
        operation: null,
        back_until: backUntil,
        targets: [
          {
            index: 0,
            ok: false,
            reason: 'The kernel is already on GPU 0: pick another GPU to move it to.'
          },
          { index: 1, ok: true, reason: null },
          {
            index: 2,
            ok: false,
            reason:
              "GPU 2 is an NVIDIA A100-SXM4-80GB, the kernel's GPU 0 an NVIDIA H200: CUDA moves a " +
              'process only between GPUs of the same model. Pick a GPU of the same model.'
          }
        ]
      }
    ];
    return route.fulfill({ json });
  });
  const drains: Request[] = [];
  page.on('request', request => {
    if (request.method() === 'POST' && request.url().includes('/drain')) {
      drains.push(request);
    }
  });

  await allowNarrowSidebar(page);
  const panel = await openPanel(page);
  await setPanelWidth(page, panel, WIDE);
  const sections = panel.locator('.jp-gpumigrate-gpu');
  await expect(sections).toHaveCount(3);
  await expect(sections.locator('.jp-gpumigrate-title')).toHaveText([
    'GPU 0 · NVIDIA H200',
    'GPU 1 · NVIDIA H200',
    'GPU 2 · NVIDIA A100-SXM4-80GB'
  ]);
  await expect(panel.locator('.jp-gpumigrate-note')).toHaveCount(0); // no "no GPU" note

  // Memory bars, as meters with their values.
  const meter = sections.nth(0).getByRole('meter', { name: 'GPU 0 memory' });
  await expect(meter).toHaveAttribute('aria-valuenow', '6');
  await expect(meter).toHaveAttribute('aria-valuetext', /^9\.\d GB of 150\.8 GB used$/);
  const fill = await meter.locator('.jp-gpumigrate-bar-fill').evaluate(el => el.style.width);
  expect(parseFloat(fill)).toBeGreaterThan(5);

  // The kernel, under GPU 0; it can move to GPU 1 only; why not elsewhere is in the tooltip.
  const row = sections.nth(0).locator('.jp-gpumigrate-kernel');
  await expect(row.locator('.jp-gpumigrate-kernel-name')).toHaveText('train.ipynb');
  await expect(row.locator('.jp-gpumigrate-details')).toContainText('8.6 GB on GPU 0');
  const moveTo = row.getByRole('combobox', { name: 'GPU to move train.ipynb to' });
  await expect(moveTo.locator('option')).toHaveText(['GPU 1']);
  await expect(moveTo).toHaveValue('1');
  await expect(moveTo).toHaveAttribute('title', /GPU 2: GPU 2 is an NVIDIA A100-SXM4-80GB/);
  await expect(
    row.getByRole('button', { name: 'Move train.ipynb to the GPU chosen' })
  ).toBeEnabled();
  await expect(page.locator('.jp-gpumigrate-status')).toHaveText('GPU 0');

  // Drain: on the GPU with a kernel; it asks first (cancelled here: nothing is sent).
  const drain = sections.nth(0).getByRole('button', { name: /^Drain GPU 0/ });
  await expect(drain).toBeEnabled();
  await expect(sections.nth(1).locator('.jp-gpumigrate-drain')).toBeDisabled();
  await drain.click();
  const dialog = page.locator('.jp-Dialog');
  await expect(dialog).toContainText('Drain GPU 0?');
  await expect(dialog).toContainText('train.ipynb');
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await expect(dialog).toHaveCount(0);
  expect(drains).toHaveLength(0);
  // Confirmed with the opt-in transplant: the body says so. This server has no GPU: it refuses, in its words.
  await drain.click();
  await dialog
    .getByRole('checkbox', { name: 'Transplant a kernel the driver cannot move' })
    .check();
  await dialog.getByRole('button', { name: 'Drain' }).click();
  await expect.poll(() => drains.length).toBe(1);
  expect(drains[0].postDataJSON()).toEqual({ transplant: true });
  await expect(
    page.locator('.Toastify__toast').filter({ hasText: /GPU 0: .*no NVIDIA GPU/ })
  ).toBeVisible();

  // To CPU: what would not carry is listed (the real kernel's dry run) before anything is done. Cancelled,
  // nothing starts; confirmed, the real kernel is transplanted, and its notebook goes on in the new process.
  await page.notebook.setCell(
    0,
    'code',
    "kept = 'across'; gen = (i for i in range(3)); print('set')"
  );
  await page.notebook.runCell(0);
  const transplants: Request[] = [];
  page.on('request', request => {
    if (request.method() === 'POST' && request.url().includes('/transplant')) {
      transplants.push(request);
    }
  });
  const toCpu = row.getByRole('button', { name: 'Transplant train.ipynb to the CPU' });
  await toCpu.click();
  await expect(dialog).toContainText('Transplant train.ipynb to the CPU?');
  await expect(dialog).toContainText(
    "Not carried: gen (generator): cannot pickle 'generator' object"
  );
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await expect(dialog).toHaveCount(0);
  expect(transplants.map(r => r.postDataJSON().dry_run)).toEqual([true]);
  await toCpu.click();
  await dialog.getByRole('button', { name: 'Transplant' }).click();
  await expect.poll(() => transplants.length).toBe(3);
  expect(transplants[2].postDataJSON()).toEqual({ to_cpu: true, accept_left: ['gen'] });
  await page.notebook.setCell(1, 'code', "print(kept, 'gen' in dir())");
  await page.notebook.runCell(1);
  await expect
    .poll(async () => (await page.notebook.getCellTextOutput(1))?.join('').trim(), {
      timeout: 60_000
    })
    .toBe('across False');

  // Back: to the process the transplant replaced, asking first; the notebook then has its generator again.
  const backs: Request[] = [];
  page.on('request', request => {
    if (request.method() === 'POST' && request.url().includes('/back')) {
      backs.push(request);
    }
  });
  backUntil = new Date(Date.now() + 3600_000).toISOString();
  const back = row.getByRole('button', {
    name: "Go back to train.ipynb's process before its transplant"
  });
  await back.click();
  await expect(dialog).toContainText('Everything the kernel did since the transplant is lost');
  await dialog.getByRole('button', { name: 'Go back' }).click();
  await expect.poll(() => backs.length).toBe(1);
  backUntil = null;
  await page.notebook.setCell(1, 'code', "print(kept, 'gen' in dir())");
  await page.notebook.runCell(1);
  await expect
    .poll(async () => (await page.notebook.getCellTextOutput(1))?.join('').trim(), {
      timeout: 60_000
    })
    .toBe('across True');

  // To GPU…: only GPUs of another model than the kernel's are offered (the driver cannot go there); the
  // dry run goes to the server, whose refusal (no GPU on this machine) is a notification.
  const transplantTo = row.getByRole('combobox', {
    name: 'GPU of another model to transplant train.ipynb to'
  });
  await expect(transplantTo.locator('option')).toHaveText(['GPU 2']);
  await row
    .getByRole('button', { name: 'Transplant train.ipynb to the GPU of another model chosen' })
    .click();
  await expect.poll(() => transplants.length).toBe(4);
  expect(transplants[3].postDataJSON()).toEqual({ to_gpu: 2, dry_run: true });
  await expect(
    page.locator('.Toastify__toast').filter({ hasText: /train\.ipynb: GPU 2 cannot be used/ })
  ).toBeVisible();
  await expect(dialog).toHaveCount(0);

  // Updates happen in place: the focused menu is the same element, still focused, after new data.
  await moveTo.focus();
  await moveTo.evaluate(el => ((el as HTMLElement).dataset.marked = 'yes'));
  const before = polls;
  await expect.poll(() => polls, { timeout: 15_000 }).toBeGreaterThan(before + 1);
  await expect(moveTo).toHaveAttribute('data-marked', 'yes');
  expect(await moveTo.evaluate(el => el === document.activeElement)).toBe(true);

  await panel.screenshot({ path: `${SHOTS}/panel-gpus-light.png` });
  await setPanelWidth(page, panel, NARROW);
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-gpus-narrow-light.png` });
  await page.theme.setDarkTheme();
  await setPanelWidth(page, panel, WIDE);
  await panel.screenshot({ path: `${SHOTS}/panel-gpus-dark.png` });
  await setPanelWidth(page, panel, NARROW);
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-gpus-narrow-dark.png` });
});
