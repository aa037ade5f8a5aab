// A real OpenID Connect provider for uibus's tests (panva's oidc-provider), driven by tests/oidckit.py.
//
//   node provider.mjs --port P [--resource URL] [--redirect-uri URL ...] [--accounts JSON]
//
// What it is set up with, and why:
// * issuer http://127.0.0.1:P, its own RSA key (generated per start: a second instance is a foreign
//   issuer with foreign keys, not the library's shared development keys);
// * the page's client `uibus-page` (secret `uibus-page-secret`; authorization code + PKCE; the
//   redirect URIs given) and the kit's client `uibus-kit` (secret `uibus-kit-secret`; redirect
//   http://127.0.0.1:9/callback, never served: tests/oidckit.py stops at it and takes the code);
// * dynamic client registration, open (MCP clients register themselves);
// * resource indicators (RFC 8707): any resource URL a client asks for becomes the JWT access token's
//   `aud` (scope `uibus`); `?ttl=N` on the resource sets the token's lifetime to N seconds (and is
//   not part of the audience), so a test can hold an expired token; without a resource the token is
//   for --resource;
// * the accounts (--accounts: {"alice": {"email": …, "groups": […], "tenant": …}}): any login works
//   (devInteractions, any password); an account not in the list has no claims besides `sub`. Their
//   `email`, `groups` and `tenant` are in the ID token and in every access token.
// It prints `ready <issuer>` on stdout once it listens.
import { generateKeyPairSync, randomUUID } from 'node:crypto';
import { parseArgs } from 'node:util';

import Provider from 'oidc-provider';

const { values: args } = parseArgs({
  options: {
    port: { type: 'string' },
    resource: { type: 'string', default: '' },
    'redirect-uri': { type: 'string', multiple: true, default: [] },
    accounts: { type: 'string', default: '{}' },
  },
});
const port = Number(args.port);
const issuer = `http://127.0.0.1:${port}`;
const accounts = JSON.parse(args.accounts);
const defaultResource = args.resource || `${issuer}/default-resource`;
const KIT_REDIRECT = 'http://127.0.0.1:9/callback';

const key = generateKeyPairSync('rsa', { modulusLength: 2048 }).privateKey.export({ format: 'jwk' });
key.kid = randomUUID();
key.use = 'sig';
key.alg = 'RS256';

function claimsOf(id) {
  const account = accounts[id] || {};
  const claims = {};
  for (const name of ['email', 'groups', 'tenant', 'name']) {
    if (account[name] !== undefined) claims[name] = account[name];
  }
  return claims;
}

function audienceOf(indicator) {
  // The audience is the resource as the client named it, less a `ttl` parameter (only a test's).
  const url = new URL(indicator);
  const ttl = Number(url.searchParams.get('ttl') || 0);
  if (!ttl) return { audience: indicator, ttl: 0 };
  url.searchParams.delete('ttl');
  return { audience: url.href, ttl };
}

const configuration = {
  clients: [
    {
      client_id: 'uibus-page',
      client_secret: 'uibus-page-secret',
      redirect_uris: [...args['redirect-uri'], KIT_REDIRECT],
      post_logout_redirect_uris: args['redirect-uri'].map((uri) => new URL('/', uri).href),
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
    },
    {
      client_id: 'uibus-kit',
      client_secret: 'uibus-kit-secret',
      redirect_uris: [KIT_REDIRECT],
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
    },
  ],
  jwks: { keys: [key] },
  cookies: { keys: ['uibus-tests-only'] },
  claims: { openid: ['sub'], email: ['email'], profile: ['name', 'groups', 'tenant'] },
  scopes: ['openid', 'offline_access', 'email', 'profile', 'uibus'],
  pkce: { required: () => true },
  async findAccount(ctx, id) {
    return { accountId: id, async claims() { return { sub: id, ...claimsOf(id) }; } };
  },
  async extraTokenClaims(ctx, token) {
    return token.accountId ? claimsOf(token.accountId) : undefined;
  },
  features: {
    devInteractions: { enabled: true },
    registration: { enabled: true },
    revocation: { enabled: true },
    rpInitiatedLogout: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => defaultResource,
      useGrantedResource: () => true,
      getResourceServerInfo(ctx, indicator) {
        const { audience, ttl } = audienceOf(indicator);
        return {
          scope: 'uibus', audience, accessTokenFormat: 'jwt', accessTokenTTL: ttl || 3600,
          jwt: { sign: { alg: 'RS256' } },
        };
      },
    },
  },
  ttl: {
    AccessToken: (ctx, token) => token.resourceServer?.accessTokenTTL || 3600,
  },
  renderError(ctx, out) {
    ctx.type = 'json';
    ctx.body = out;
  },
};

const provider = new Provider(issuer, configuration);
provider.on('server_error', (ctx, err) => console.error('server_error', err));
provider.listen(port, '127.0.0.1', () => {
  console.log(`ready ${issuer}`);
});
