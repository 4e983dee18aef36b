// The admin API as the console uses it. The token lives in sessionStorage: this tab only,
// gone when it closes, and never in a cookie, so there is nothing for CSRF to ride on.

const KEY = 'callbackd.adminToken';

export const token = () => sessionStorage.getItem(KEY);
export const setToken = (t) => sessionStorage.setItem(KEY, t);
export const forgetToken = () => sessionStorage.removeItem(KEY);

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  get refused() {
    return this.status === 401 || this.status === 403;
  }
}

export async function api(path, { method = 'GET', body } = {}) {
  const headers = { Authorization: `Bearer ${token() ?? ''}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: 'no-store',
  });
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    throw new ApiError(response.status, data?.error ?? 'error', data?.message ?? response.statusText);
  }
  return data;
}

// A resend requestId: a repeated click or a retried request resends nothing twice.
// getRandomValues works on plain-HTTP origins too, where randomUUID does not.
export function requestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return 'console-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
}
