//! The shared conformance suite on master + replica + 3 Sentinels (`redis+sentinel://…/mymaster`).
//!
//! Every client is its own `RedisBackend` logged in as its own ACL user, created on the master and on
//! the replica (it may be promoted); cutting a client disables its user and kills its connections on
//! both (see `support`), so only that client is partitioned. The backend passes the URL's credentials
//! to the master it resolves, not to the Sentinels (which have no ACL users here): the clients working
//! at all shows the credentials reach the master, and the cut taking effect shows every connection of
//! the client (commands and pub/sub) uses them. Other processes (`distlock run`) use the default user,
//! which is never cut.
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedisBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::sentinel::SentinelGroup;
use support::{with_credentials, AclUser, Shared};

static GROUP: Shared<SentinelGroup> = Shared::new();

struct Sentinel {
    group: Arc<SentinelGroup>,
    nodes: Vec<SocketAddr>,
}

#[async_trait::async_trait]
impl Provider for Sentinel {
    async fn client(&self) -> Client {
        let user = AclUser::create(&self.nodes).await;
        let url = with_credentials(&self.group.url(), &user.credentials());
        let backend = RedisBackend::connect(&LockUrl::parse(&url).expect("url"))
            .await
            .expect("connect as the client's own user");
        // The credentials reached the master the Sentinels named (and the Sentinels, which have no such
        // user, were asked without them: connecting would have failed otherwise).
        let master = self.group.master().addr();
        assert_eq!(
            user.connected_nodes().await,
            vec![master],
            "{} is not logged in on the master (only)",
            user.name
        );
        Client::new(Locks::new(backend))
            .with_cut(user.cut_hook())
            .with_heal(user.heal_hook())
    }

    fn url(&self) -> Option<String> {
        Some(self.group.url())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn sentinel() -> Sentinel {
    let group = GROUP.get(SentinelGroup::start_or_panic).await;
    let nodes = vec![group.master().addr(), group.replica().addr()];
    Sentinel { group, nodes }
}

distlock_testkit::conformance_suite!(sentinel);
