//! ZooKeeper's round trips for `distlock bench --url zk://…`, on a plain `zookeeper-client` session:
//! an ephemeral sequential `create` (the lock node's create), a `getChildren` (the holder read), and a
//! `create` followed by a `delete` (the release's delete is the difference). distlock's uncontended
//! cycle is one create pipelined with one getChildren, then one delete.

use std::time::Duration;

use distlock::zookeeper::ZkConfig;
use zookeeper_client as zk;

use crate::error::Error;
use crate::harness::Cycler;

fn failure(e: zk::Error) -> Error {
    Error::unavailable(format!("zookeeper baseline: {e}"))
}

/// A plain session on the config's servers (and its digest credentials); paths are made under the
/// config's chroot by the callers.
pub async fn connect(config: &ZkConfig) -> Result<zk::Client, Error> {
    let mut connector = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(30))
        .with_connection_timeout(config.connection.connect_timeout);
    if let (Some(user), Some(password)) = (&config.connection.username, &config.connection.password)
    {
        connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
    }
    connector
        .connect(&config.endpoints.join(","))
        .await
        .map_err(failure)
}

/// The parent every baseline node goes under: `<chroot>/distlock-bench-rtt-<run>/<what>`, created.
pub async fn parent(
    client: &zk::Client,
    config: &ZkConfig,
    run: &str,
    what: &str,
) -> Result<String, Error> {
    let path = format!(
        "{}/distlock-bench-rtt-{run}/{what}",
        config.chroot.as_deref().unwrap_or("")
    );
    let options = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
    client.mkdir(&path, &options).await.map_err(failure)?;
    Ok(path)
}

fn ephemeral_sequential() -> zk::CreateOptions<'static> {
    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all())
}

/// One ephemeral sequential create (the nodes stay until the session closes).
#[derive(Debug)]
pub struct Create {
    pub client: zk::Client,
    pub prefix: String,
}

impl Create {
    /// One create outside a measurement.
    pub async fn acquire_once(&self) -> Result<(), Error> {
        self.client
            .create(&self.prefix, b"x", &ephemeral_sequential())
            .await
            .map(drop)
            .map_err(failure)
    }
}

impl Cycler for Create {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        self.acquire_once().await?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// One getChildren of a parent with one child.
#[derive(Debug)]
pub struct GetChildren {
    pub client: zk::Client,
    pub parent: String,
}

impl Cycler for GetChildren {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        self.client
            .list_children(&self.parent)
            .await
            .map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// A create, then the delete of that node.
#[derive(Debug)]
pub struct CreateDelete {
    pub client: zk::Client,
    pub prefix: String,
}

impl Cycler for CreateDelete {
    type Held = String;

    async fn acquire(&self, _wait: Duration) -> Result<Option<String>, Error> {
        let (_, sequence) = self
            .client
            .create(&self.prefix, b"x", &ephemeral_sequential())
            .await
            .map_err(failure)?;
        Ok(Some(format!("{}{sequence}", self.prefix)))
    }

    async fn release(&self, path: String) -> Result<(), Error> {
        self.client.delete(&path, None).await.map_err(failure)
    }
}
