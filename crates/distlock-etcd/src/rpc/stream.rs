//! The two bidirectional streams the backend uses: lease keep-alives and watches. Requests are sent
//! on a channel the gRPC stream reads from; replies are read with `message`.

use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use super::pb::etcdserverpb::{
    watch_request, LeaseKeepAliveRequest, LeaseKeepAliveResponse, WatchCancelRequest,
    WatchCreateRequest, WatchRequest, WatchResponse,
};

/// A request stream for tonic fed from a channel (the stream ends when the sender is dropped).
pub(super) fn request_stream<T: Send + 'static>(
    requests: mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::unfold(requests, |mut requests| async move {
        requests.recv().await.map(|request| (request, requests))
    })
}

/// The request channel of a stream whose gRPC call has ended (tonic dropped its request stream).
fn closed(what: &str) -> Status {
    Status::unavailable(format!("the {what} stream is closed"))
}

/// A lease keep-alive stream (`Lease/LeaseKeepAlive`), opened by
/// [`Client::lease_keep_alive`](super::Client::lease_keep_alive).
#[derive(Debug)]
pub struct KeepAliveStream {
    pub(super) lease: i64,
    pub(super) requests: mpsc::Sender<LeaseKeepAliveRequest>,
    pub(super) replies: Streaming<LeaseKeepAliveResponse>,
}

impl KeepAliveStream {
    /// One keep-alive round trip: sends a keep-alive for the lease and reads the next reply (`None`:
    /// the server closed the stream). A reply with `ttl <= 0` means the lease is gone.
    pub async fn keep_alive(&mut self) -> Result<Option<LeaseKeepAliveResponse>, Status> {
        self.requests
            .send(LeaseKeepAliveRequest { id: self.lease })
            .await
            .map_err(|_| closed("keep-alive"))?;
        self.replies.message().await
    }
}

/// A watch stream (`Watch/Watch`), opened by [`Client::watch`](super::Client::watch) with its first
/// watch; more watches are added with [`watch`](Self::watch) and removed with [`cancel`](Self::cancel).
#[derive(Debug)]
pub struct WatchStream {
    pub(super) requests: mpsc::Sender<WatchRequest>,
    pub(super) replies: Streaming<WatchResponse>,
}

impl WatchStream {
    /// Adds a watch to the stream.
    pub async fn watch(&mut self, create: WatchCreateRequest) -> Result<(), Status> {
        self.send(watch_request::RequestUnion::CreateRequest(create))
            .await
    }

    /// Cancels the watch `watch_id`.
    pub async fn cancel(&mut self, watch_id: i64) -> Result<(), Status> {
        self.send(watch_request::RequestUnion::CancelRequest(
            WatchCancelRequest { watch_id },
        ))
        .await
    }

    /// The next reply (`None`: the server closed the stream).
    pub async fn message(&mut self) -> Result<Option<WatchResponse>, Status> {
        self.replies.message().await
    }

    async fn send(&mut self, request: watch_request::RequestUnion) -> Result<(), Status> {
        self.requests
            .send(WatchRequest {
                request_union: Some(request),
            })
            .await
            .map_err(|_| closed("watch"))
    }
}
