// The panel in a real JupyterLab, a real server with jupyter-gpumigrate and real CRIU, in Debian's Chromium.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';

const SHOTS = 'test-results/screenshots';

/** No element of the panel is wider than the panel: nothing overflows sideways. */
async function overflowing(panel: Locator): Promise<string[]> {
  return panel.evaluate(root => {
    const limit = root.getBoundingClientRect().right + 0.5;
    return Array.from(root.querySelectorAll<HTMLElement>('*'))
      .filter(el => el.getBoundingClientRect().right > limit || el.scrollWidth > el.clientWidth + 1)
      .filter(
        el =>
          getComputedStyle(el).overflow !== 'hidden' &&
          getComputedStyle(el).textOverflow !== 'ellipsis'
      )
      .map(el => `${el.tagName.toLowerCase()}.${el.className}`);
  });
}

async function openPanel(page: IJupyterLabPageFixture): Promise<Locator> {
  await page.sidebar.openTab('jp-gpumigrate-panel');
  const panel = page.locator('#jp-gpumigrate-panel');
  await expect(panel).toBeVisible();
  return panel;
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

  await running.locator('.jp-gpumigrate-suspend').click();
  const suspended = panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel');
  await expect(suspended).toHaveAttribute('data-state', 'suspended');
  await expect(suspended.locator('.jp-gpumigrate-details')).toContainText('on disk');
  await expect(status).toHaveText('Kernel suspended');
  await panel.screenshot({ path: `${SHOTS}/panel-suspended-light.png` });

  await suspended.locator('.jp-gpumigrate-resume').click();
  await expect(running).toHaveAttribute('data-state', 'running');
  await expect(panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel')).toHaveCount(0);
  await expect(status).toHaveText('CPU');

  // The same tab, never reloaded, runs the next cell in the resumed kernel.
  await page.notebook.setCell(1, 'code', 'print(secret)');
  await page.notebook.runCell(1);
  expect(await page.notebook.getCellTextOutput(1)).toEqual(['kept across suspend\n']);
});

test('the panel in light and dark themes, and at a narrow width', async ({ page }) => {
  await page.notebook.createNew('a-notebook-with-a-rather-long-name-for-a-narrow-sidebar.ipynb');
  await page.notebook.setCell(0, 'code', 'x = 1');
  await page.notebook.runCell(0);
  const panel = await openPanel(page);
  await expect(panel.locator('.jp-gpumigrate-kernel')).toHaveCount(1);
  await panel.screenshot({ path: `${SHOTS}/panel-light.png` });

  // As narrow as JupyterLab lets a sidebar be (its themes' --jp-sidebar-min-width, 250px).
  await page.sidebar.setWidth(180, 'left');
  expect((await panel.boundingBox())?.width).toBeLessThanOrEqual(260);
  await expect(panel.locator('.jp-gpumigrate-suspend')).toBeVisible();
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-narrow-light.png` });

  await page.theme.setDarkTheme();
  await page.sidebar.setWidth(300, 'left');
  await panel.screenshot({ path: `${SHOTS}/panel-dark.png` });
  await page.sidebar.setWidth(180, 'left');
  expect(await overflowing(panel)).toEqual([]);
  await panel.screenshot({ path: `${SHOTS}/panel-narrow-dark.png` });
});

test('a refused action is a notification with the server’s sentence', async ({ page }) => {
  await page.notebook.createNew('refused.ipynb');
  const panel = await openPanel(page);
  const row = panel.locator('.jp-gpumigrate-kernel');
  await expect(row).toHaveCount(1);
  // Suspend twice in a row: the second request arrives while the first runs, and is refused.
  const suspend = row.locator('.jp-gpumigrate-suspend');
  await suspend.evaluate(el => {
    (el as HTMLButtonElement).click();
    (el as HTMLButtonElement).click();
  });
  // Refused either while the first runs, or because it is done: both say so in the server's words.
  await expect(
    page
      .locator('.Toastify__toast')
      .filter({ hasText: /already being moved|is suspended, so it cannot be suspended/ })
  ).toBeVisible();
  await expect(panel.locator('.jp-gpumigrate-suspended .jp-gpumigrate-kernel')).toHaveAttribute(
    'data-state',
    'suspended'
  );
});
