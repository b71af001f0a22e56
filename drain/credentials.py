"""AWS credentials for :class:`~ckptfs.drain.s3store.S3Store`: botocore's standard chain,
resolved and refreshed in worker threads, handed to the aiobotocore client.

aiobotocore's own chain does not run under trio unless the session's *default* client
config names the httpx backend, and even then it reads token and config files on the
event loop. So the chain that resolves credentials is botocore's synchronous one
(:func:`botocore.credentials.create_credential_resolver`, the chain the AWS CLI uses):
environment, ``AWS_PROFILE`` / shared config and credentials files (static keys,
``credential_process``, ``role_arn`` + ``source_profile``, SSO), web identity (IRSA:
``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``, through STS), the container endpoint
(``AWS_CONTAINER_CREDENTIALS_FULL_URI`` / ``_RELATIVE_URI`` with
``AWS_CONTAINER_AUTHORIZATION_TOKEN(_FILE)``: EKS Pod Identity, ECS) and IMDSv2 (EC2
instance profiles). Every fetch, the first one and each refresh, runs in a worker thread
(``trio.to_thread``); the event loop only compares an expiry time with the clock.

Credentials with an expiry come back as botocore's ``RefreshableCredentials``; the client
gets :class:`ThreadedRefreshableCredentials` over them, which every signature of the
client goes through (aiobotocore requests, the presigned URLs of the urllib3 GETs, the
``sendfile`` UploadParts, which are signed by the client before they leave), so each
signs with credentials that botocore considers fresh: refreshed in its advisory window
(15 min before expiry; a failure there keeps the current ones), and before anything is
signed in its mandatory window (10 min; a failure there is the request's error).
"""

from __future__ import annotations

import botocore.credentials
import botocore.exceptions
import botocore.session
import trio
from aiobotocore.credentials import AioCredentials
from botocore.credentials import ReadOnlyCredentials, RefreshableCredentials

__all__ = ["ThreadedCredentialResolver", "ThreadedRefreshableCredentials"]


class ThreadedRefreshableCredentials:
    """aiobotocore-facing credentials over botocore's (synchronous) ``RefreshableCredentials``.

    ``get_frozen_credentials`` is what aiobotocore's signer awaits. It returns the current
    set at once while botocore needs no refresh; otherwise one task at a time refreshes in
    a worker thread (botocore's refresh: the provider's fetch, its own lock and windows)
    while the others keep signing with the current set, unless that set is in the
    mandatory window, where they wait for the refresh."""

    def __init__(self, creds: RefreshableCredentials, frozen: ReadOnlyCredentials):
        self._creds = creds
        self._frozen = frozen
        self._lock = trio.Lock()
        self.method = creds.method
        #: refreshes that ran (a count for tests; the credentials themselves are never logged)
        self.refreshes = 0

    def _mandatory(self) -> bool:
        # botocore keeps its mandatory window (10 min) in an attribute of its own
        return self._creds.refresh_needed(getattr(self._creds, "_mandatory_refresh_timeout", 10 * 60))

    async def get_frozen_credentials(self) -> ReadOnlyCredentials:
        if not self._creds.refresh_needed():
            return self._frozen
        if self._lock.locked() and not self._mandatory():
            return self._frozen  # another task is refreshing; these are still good
        seen = self._frozen
        async with self._lock:
            # (not again if another task refreshed them while this one waited)
            if self._frozen is seen and self._creds.refresh_needed():
                self._frozen = await _in_thread(self._creds.get_frozen_credentials)
                self.refreshes += 1
        return self._frozen

    def get_deferred_property(self, name: str):  # botocore's endpoint builtins (account id)
        return lambda: getattr(self._frozen, name, None)

    async def get_account_id(self) -> str | None:
        return getattr(await self.get_frozen_credentials(), "account_id", None)


class ThreadedCredentialResolver:
    """Stands in for aiobotocore's credential resolver (the session component
    ``credential_provider``): resolves botocore's standard chain in a worker thread."""

    def __init__(self, *, profile: str | None, region: str | None):
        self._profile = profile
        self._region = region
        self.method: str | None = None

    def _load(self):
        session = botocore.session.Session(profile=self._profile)
        resolver = botocore.credentials.create_credential_resolver(session, region_name=self._region)
        creds = resolver.load_credentials()
        if creds is None:
            return None, None
        return creds, creds.get_frozen_credentials()

    async def load_credentials(self):
        creds, frozen = await _in_thread(self._load)
        if creds is None:
            return None
        self.method = creds.method
        if isinstance(creds, RefreshableCredentials):
            return ThreadedRefreshableCredentials(creds, frozen)
        return AioCredentials(
            frozen.access_key,
            frozen.secret_key,
            frozen.token,
            method=creds.method,
            account_id=getattr(frozen, "account_id", None),
        )


async def _in_thread(fn):
    """``fn()`` in a worker thread; an STS refusal (web identity, assumed roles) as a
    ``CredentialRetrievalError``, not as an error of the S3 request being signed."""
    try:
        return await trio.to_thread.run_sync(fn)
    except botocore.exceptions.ClientError as e:
        raise botocore.exceptions.CredentialRetrievalError(provider="sts", error_msg=str(e)) from e
