//! distlock-etcd's own gRPC client for etcd's v3 API: the message types and client stubs generated
//! from etcd's protos ([`pb`], checked in, so building needs no `protoc`) and a small [`Client`] over
//! them that connects to a list of members, speaks TLS, authenticates, and re-authenticates when the
//! server says its token is no longer valid.
//!
//! This is the interface the backend is built on, public for what sits next to the locks: fenced
//! writes ([`layout::fenced_put`](crate::layout::fenced_put) committed with
//! [`EtcdBackend::client`](crate::EtcdBackend::client)), tests, and benchmarks. It is not a general
//! etcd client: it has the requests distlock needs, nothing for cluster or user management.
//!
//! Requests (and streams) go to the members in turn, one lazily connected channel per member; a
//! request that lands on a dead member fails with [`tonic::Code::Unavailable`], and the backend
//! retries its requests (all compare-guarded) per its config's
//! [`connection.retry`](crate::EtcdConfig::connection), on the next member.
//! The raw [`Client`] does not retry: its caller decides.

mod client;
mod codec;
#[allow(unreachable_pub)]
mod generated;
mod stream;

pub use client::Client;
pub use stream::{KeepAliveStream, WatchStream};
/// The outcome of a failed request (tonic's), and its gRPC code.
pub use tonic::{Code, Status};

/// etcd's v3 API types and client stubs, as prost and tonic generate them from the vendored protos
/// (`crates/distlock-etcd/proto/`).
pub mod pb {
    pub use super::generated::authpb;
    pub use super::generated::etcdserverpb;
    pub use super::generated::mvccpb;
    pub use super::generated::v3lockpb;
}
