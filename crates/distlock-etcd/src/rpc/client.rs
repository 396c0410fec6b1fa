//! The connection to etcd: one tonic channel per member, used in turn, TLS, and the auth token.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic::{Code, Request, Response, Status};

use super::pb::etcdserverpb::auth_client::AuthClient;
use super::pb::etcdserverpb::kv_client::KvClient;
use super::pb::etcdserverpb::lease_client::LeaseClient;
use super::pb::etcdserverpb::maintenance_client::MaintenanceClient;
use super::pb::etcdserverpb::watch_client::WatchClient;
use super::pb::etcdserverpb::{
    watch_request, AuthenticateRequest, CompactionRequest, CompactionResponse, DeleteRangeRequest,
    DeleteRangeResponse, LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest,
    LeaseRevokeRequest, LeaseRevokeResponse, LeaseTimeToLiveRequest, LeaseTimeToLiveResponse,
    PutRequest, PutResponse, RangeRequest, RangeResponse, StatusRequest, StatusResponse,
    TxnRequest, TxnResponse, WatchCreateRequest, WatchRequest,
};
use super::pb::v3lockpb::lock_client::LockClient;
use super::pb::v3lockpb::{LockRequest, LockResponse, UnlockRequest, UnlockResponse};
use super::stream::{request_stream, KeepAliveStream, WatchStream};
use crate::config::EtcdConfig;
use crate::error::EtcdError;

/// The metadata header etcd reads the auth token from.
const TOKEN_HEADER: &str = "token";

/// How often HTTP/2 pings check an idle connection: a dead connection (a blackholed peer) is found
/// within this plus the request timeout.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(2);

/// Adds the current auth token (if any) to every request.
#[derive(Clone, Default)]
struct TokenInterceptor {
    token: Arc<RwLock<Option<AsciiMetadataValue>>>,
}

impl TokenInterceptor {
    fn current(&self) -> Option<AsciiMetadataValue> {
        match self.token.read() {
            Ok(token) => token.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, token: AsciiMetadataValue) {
        match self.token.write() {
            Ok(mut slot) => *slot = Some(token),
            Err(poisoned) => *poisoned.into_inner() = Some(token),
        }
    }
}

impl tonic::service::Interceptor for TokenInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = self.current() {
            request.metadata_mut().insert(TOKEN_HEADER, token);
        }
        Ok(request)
    }
}

/// The username and password, and the serialisation of token refreshes.
struct Credentials {
    username: String,
    password: String,
    refreshing: tokio::sync::Mutex<()>,
}

/// The channel every request goes through: the member's channel plus the token.
type Authorized = InterceptedService<Channel, TokenInterceptor>;

/// A connection to an etcd cluster. Cheap to clone (clones share the channel and the token).
///
/// Every request returns etcd's answer or its [`tonic::Status`]. A request refused with
/// [`Code::Unauthenticated`] (etcd's "invalid auth token": the token expired, or the member restarted)
/// is sent once more after authenticating again, when credentials are configured. A refusal of the
/// credentials themselves (etcd answers `Authenticate` with `InvalidArgument`) is reported as
/// [`Code::Unauthenticated`].
#[derive(Clone)]
pub struct Client {
    /// One lazily connected channel per member, used in turn (see [`Client::channel`]).
    channels: Arc<[Channel]>,
    next: Arc<AtomicUsize>,
    interceptor: TokenInterceptor,
    credentials: Option<Arc<Credentials>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field(
                "username",
                &self.credentials.as_ref().map(|c| c.username.as_str()),
            )
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to the members of `config` (endpoints, TLS and CA, credentials, connect timeout):
    /// authenticates when credentials are set (retried per `config.connection.retry` within the
    /// connect timeout). The connection itself is made lazily, by the first request.
    pub async fn connect(config: &EtcdConfig) -> distlock_core::Result<Client> {
        let client = Client::new(config).map_err(|e| e.into_core(None))?;
        if client.credentials.is_some() {
            let deadline = tokio::time::Instant::now() + config.connection.connect_timeout;
            distlock_core::retry::retry(
                &config.connection.retry,
                Some(deadline),
                |_| async {
                    match tokio::time::timeout_at(deadline, client.authenticate()).await {
                        Ok(result) => result,
                        Err(_) => Err(Status::deadline_exceeded("authentication timed out")),
                    }
                },
                |status| status.code() == Code::Unavailable,
            )
            .await
            .map_err(|source| {
                EtcdError::Connect {
                    endpoints: config.endpoints.join(","),
                    source,
                }
                .into_core(None)
            })?;
        }
        Ok(client)
    }

    /// The client of `config`, without any I/O (the channel connects on the first request). Needs a
    /// tokio runtime: the channels' connections run tasks on it.
    pub(crate) fn new(config: &EtcdConfig) -> Result<Client, EtcdError> {
        config.check()?;
        let tls = config
            .connection
            .tls
            .then(|| tls_config(config))
            .transpose()?;
        let scheme = if config.connection.tls {
            "https"
        } else {
            "http"
        };
        let mut endpoints = Vec::new();
        for endpoint in config.parsed_endpoints()? {
            let uri = format!("{scheme}://{endpoint}");
            let mut endpoint = tonic::transport::Endpoint::from_shared(uri.clone())
                .map_err(|e| EtcdError::Config(format!("bad etcd endpoint {uri}: {e}")))?
                .connect_timeout(config.connection.connect_timeout)
                .http2_keep_alive_interval(HTTP2_PING_INTERVAL)
                .keep_alive_timeout(config.connection.request_timeout)
                .keep_alive_while_idle(true);
            if let Some(tls) = &tls {
                endpoint = endpoint
                    .tls_config(tls.clone())
                    .map_err(|e| EtcdError::Config(format!("cannot set up TLS for {uri}: {e}")))?;
            }
            endpoints.push(endpoint);
        }
        let credentials = match (&config.connection.username, &config.connection.password) {
            (Some(username), Some(password)) => Some(Arc::new(Credentials {
                username: username.clone(),
                password: password.clone(),
                refreshing: tokio::sync::Mutex::new(()),
            })),
            _ => None,
        };
        Ok(Client {
            channels: endpoints.iter().map(|e| e.connect_lazy()).collect(),
            next: Arc::new(AtomicUsize::new(0)),
            interceptor: TokenInterceptor::default(),
            credentials,
        })
    }

    /// Whether requests need a token that this client has not obtained yet.
    pub(crate) fn needs_token(&self) -> bool {
        self.credentials.is_some() && self.interceptor.current().is_none()
    }

    /// Authenticates with the configured credentials (nothing without them) and keeps the token.
    pub(crate) async fn authenticate(&self) -> Result<(), Status> {
        let Some(credentials) = &self.credentials else {
            return Ok(());
        };
        let request = AuthenticateRequest {
            name: credentials.username.clone(),
            password: credentials.password.clone(),
        };
        let reply = AuthClient::new(self.channel())
            .authenticate(request)
            .await
            .map_err(|status| match status.code() {
                // etcd's "authentication failed, invalid user ID or password" and "user name is
                // empty": the credentials are refused, whatever the code says.
                Code::InvalidArgument => Status::unauthenticated(status.message()),
                _ => status,
            })?
            .into_inner();
        let token = AsciiMetadataValue::try_from(reply.token)
            .map_err(|_| Status::internal("etcd answered an auth token that is not ASCII"))?;
        self.interceptor.set(token);
        Ok(())
    }

    /// The token requests are sent with now (compared, never shown: it is a credential).
    pub(crate) fn token(&self) -> Option<AsciiMetadataValue> {
        self.interceptor.current()
    }

    /// Authenticates again unless another request did since `stale` was sent.
    pub(crate) async fn refresh_token(
        &self,
        stale: Option<AsciiMetadataValue>,
    ) -> Result<(), Status> {
        let Some(credentials) = &self.credentials else {
            return Ok(());
        };
        let _serial = credentials.refreshing.lock().await;
        if self.interceptor.current() != stale {
            return Ok(());
        }
        tracing::debug!("etcd: the auth token was refused; authenticating again");
        self.authenticate().await
    }

    /// Sends a request; one refused for its token is sent again after authenticating again.
    async fn call<T, F, Fut>(&self, request: F) -> Result<T, Status>
    where
        F: Fn(Authorized) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let sent_with = self.interceptor.current();
        match request(self.authorized()).await {
            Err(status) if status.code() == Code::Unauthenticated && self.credentials.is_some() => {
                self.refresh_token(sent_with).await?;
                request(self.authorized()).await.map(Response::into_inner)
            }
            other => other.map(Response::into_inner),
        }
    }

    fn authorized(&self) -> Authorized {
        InterceptedService::new(self.channel(), self.interceptor.clone())
    }

    /// The channel of the member whose turn it is. Requests go to the members in turn rather than at
    /// random (tonic's balancer picks at random among the members whose connection is "ready", and
    /// a member that stopped answering without closing its connection stays ready): a request sent
    /// again because the first send got no answer goes to another member.
    fn channel(&self) -> Channel {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        // `new` refuses an empty endpoint list, so there is always a channel.
        self.channels[turn % self.channels.len()].clone()
    }

    /// `KV/Range`.
    pub async fn range(&self, request: RangeRequest) -> Result<RangeResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { KvClient::new(c).range(request).await }
        })
        .await
    }

    /// `KV/Put`.
    pub async fn put(&self, request: PutRequest) -> Result<PutResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { KvClient::new(c).put(request).await }
        })
        .await
    }

    /// `KV/DeleteRange`.
    pub async fn delete_range(
        &self,
        request: DeleteRangeRequest,
    ) -> Result<DeleteRangeResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { KvClient::new(c).delete_range(request).await }
        })
        .await
    }

    /// `KV/Txn`.
    pub async fn txn(&self, request: TxnRequest) -> Result<TxnResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { KvClient::new(c).txn(request).await }
        })
        .await
    }

    /// `KV/Compact`.
    pub async fn compact(&self, request: CompactionRequest) -> Result<CompactionResponse, Status> {
        self.call(|c| async move { KvClient::new(c).compact(request).await })
            .await
    }

    /// `Lease/LeaseGrant`.
    pub async fn lease_grant(
        &self,
        request: LeaseGrantRequest,
    ) -> Result<LeaseGrantResponse, Status> {
        self.call(|c| async move { LeaseClient::new(c).lease_grant(request).await })
            .await
    }

    /// `Lease/LeaseRevoke`.
    pub async fn lease_revoke(&self, id: i64) -> Result<LeaseRevokeResponse, Status> {
        self.call(|c| async move {
            LeaseClient::new(c)
                .lease_revoke(LeaseRevokeRequest { id })
                .await
        })
        .await
    }

    /// `Lease/LeaseTimeToLive`.
    pub async fn lease_time_to_live(&self, id: i64) -> Result<LeaseTimeToLiveResponse, Status> {
        self.call(|c| async move {
            LeaseClient::new(c)
                .lease_time_to_live(LeaseTimeToLiveRequest { id, keys: false })
                .await
        })
        .await
    }

    /// Opens a `Lease/LeaseKeepAlive` stream for lease `id` with a first keep-alive, and returns it
    /// with the first reply (`ttl <= 0`: the lease is gone).
    pub async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<
        (
            KeepAliveStream,
            super::pb::etcdserverpb::LeaseKeepAliveResponse,
        ),
        Status,
    > {
        let mut stream = self
            .call(|c| async move {
                let (requests, receiver) = mpsc::channel(4);
                // The receiver is alive: this cannot fail.
                let _ = requests.send(LeaseKeepAliveRequest { id }).await;
                let replies = LeaseClient::new(c)
                    .lease_keep_alive(request_stream(receiver))
                    .await?;
                Ok(replies.map(|replies| KeepAliveStream {
                    lease: id,
                    requests,
                    replies,
                }))
            })
            .await?;
        match stream.replies.message().await? {
            Some(first) => Ok((stream, first)),
            None => Err(Status::unavailable(
                "the keep-alive stream closed before its first reply",
            )),
        }
    }

    /// Opens a `Watch/Watch` stream with its first watch.
    pub async fn watch(&self, create: WatchCreateRequest) -> Result<WatchStream, Status> {
        self.call(|c| {
            let create = create.clone();
            async move {
                let (requests, receiver) = mpsc::channel(16);
                // The receiver is alive: this cannot fail.
                let _ = requests
                    .send(WatchRequest {
                        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
                    })
                    .await;
                let replies = WatchClient::new(c).watch(request_stream(receiver)).await?;
                Ok(replies.map(|replies| WatchStream { requests, replies }))
            }
        })
        .await
    }

    /// `Maintenance/Status` of the member the request lands on.
    pub async fn status(&self) -> Result<StatusResponse, Status> {
        self.call(|c| async move { MaintenanceClient::new(c).status(StatusRequest {}).await })
            .await
    }

    /// etcd's server-side lock (`v3lockpb.Lock/Lock`): waits until `name` is held on `lease`.
    pub async fn lock(&self, request: LockRequest) -> Result<LockResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { LockClient::new(c).lock(request).await }
        })
        .await
    }

    /// etcd's server-side unlock (`v3lockpb.Lock/Unlock`): deletes the key `Lock` returned.
    pub async fn unlock(&self, request: UnlockRequest) -> Result<UnlockResponse, Status> {
        self.call(|c| {
            let request = request.clone();
            async move { LockClient::new(c).unlock(request).await }
        })
        .await
    }
}

/// TLS for `etcds://`: the CA file alone when one is named (as `etcdctl --cacert`), else the system
/// roots.
fn tls_config(config: &EtcdConfig) -> Result<ClientTlsConfig, EtcdError> {
    let tls = ClientTlsConfig::new();
    Ok(match &config.connection.ca_file {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| {
                EtcdError::Config(format!("cannot read the CA file {}: {e}", path.display()))
            })?;
            tls.ca_certificate(Certificate::from_pem(pem))
        }
        None => tls.with_native_roots(),
    })
}
