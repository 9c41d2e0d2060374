// Galata's configuration, with Debian's Chromium (no browser download) and a server of our own.
import { defineConfig } from '@playwright/test';
// eslint-disable-next-line @typescript-eslint/no-require-imports
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const PORT = Number(process.env.GPUMIGRATE_UI_PORT ?? 8899);

export default defineConfig({
  ...baseConfig,
  testDir: './tests',
  outputDir: './test-results/artifacts',
  timeout: 180_000,
  expect: { timeout: 60_000 },
  retries: 0,
  workers: 1,
  reporter: [['list']],
  use: {
    ...baseConfig.use,
    baseURL: `http://127.0.0.1:${PORT}`,
    trace: 'retain-on-failure',
    video: 'off', // recording needs Playwright's own ffmpeg download
    launchOptions: {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      // As root, without a GPU, on a machine whose network reaches nothing but package registries.
      args: [
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
        '--disable-quic',
        '--no-first-run'
      ]
    }
  },
  webServer: {
    command: `jupyter lab --config jupyter_server_test_config.py --port ${PORT}`,
    url: `http://127.0.0.1:${PORT}/lab`,
    timeout: 120_000,
    reuseExistingServer: false,
    stdout: 'pipe',
    stderr: 'pipe'
  }
});
