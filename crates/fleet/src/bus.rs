//! The connection to NATS and the fleet's bucket.
//!
//! Nodes write their [`NodeRecord`] to the JetStream key-value bucket [`BUCKET`]
//! under `nodes.<node_id>` every [`REFRESH`]; an entry not refreshed for [`TTL`]
//! expires, which is how a dead node leaves. The bucket keeps one value per key in
//! memory: it is observed state, rebuilt within a second by the nodes themselves.

use crate::record::{NodeId, NodeRecord};
use crate::seal;
use async_nats::jetstream::{self, kv};
use async_nats::{Client, ConnectOptions, ServerAddr};
use pdserve_kv_transfer::ClusterKey;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// The bucket of node records.
pub const BUCKET: &str = "INFER_LOAD";
/// How often a node writes its record.
pub const REFRESH: Duration = Duration::from_secs(1);
/// How long a record outlives its last write.
pub const TTL: Duration = Duration::from_secs(3);
const KEY_PREFIX: &str = "nodes.";
/// The longest pause between two attempts to reach NATS.
const MAX_RETRY: Duration = Duration::from_secs(5);
/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the bucket is waited for (a new cluster elects its JetStream leader first).
const BUCKET_PATIENCE: Duration = Duration::from_secs(30);

/// How to reach NATS. Credentials come from `creds` (a `.creds` file), else from
/// `PDSERVE_NATS_USER` + `PDSERVE_NATS_PASSWORD` or `PDSERVE_NATS_TOKEN`.
/// `PDSERVE_NATS_INBOX_PREFIX` replaces `_INBOX` as the prefix of the subjects replies
/// come to, so a server's permissions can give each user its own
/// (`deploy/nats/permissions.conf`).
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// One server or several, comma separated (`nats://a:4222,nats://b:4222`).
    pub url: String,
    pub creds: Option<PathBuf>,
    /// Copies of the bucket in a JetStream cluster (1 on a single server).
    pub replicas: usize,
    /// The connection's name, as NATS monitoring shows it.
    pub client_name: String,
    /// Seals what this process writes to the bucket and opens what it reads there
    /// (see `seal`); `None` reads without checking, for tools that only show.
    pub key: Option<ClusterKey>,
}

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("NATS URL `{url}`: {why}")]
    Url { url: String, why: String },
    #[error("cannot read NATS credentials {}: {source}", path.display())]
    Creds { path: PathBuf, source: std::io::Error },
    #[error("cannot connect to NATS at {url}: {why}")]
    Connect { url: String, why: String },
    #[error("NATS bucket {BUCKET}: {0}")]
    Bucket(String),
}

/// A connection to NATS with the fleet's bucket open. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    client: Client,
    store: kv::Store,
    replicas: usize,
    key: Option<ClusterKey>,
}

impl Bus {
    /// Connects once (no retry: callers that must wait for NATS loop on this), then
    /// opens the bucket, creating it if no one has yet.
    pub async fn connect(cfg: &NatsConfig) -> Result<Bus, FleetError> {
        let addrs = server_addrs(&cfg.url)?;
        let url = cfg.url.clone();
        let opts = options(cfg).await?;
        let client = async_nats::connect_with_options(addrs.as_slice(), opts)
            .await
            .map_err(|e| FleetError::Connect { url, why: e.to_string() })?;
        let store = open_bucket(&client, cfg.replicas, BUCKET_PATIENCE).await?;
        Ok(Bus { client, store, replicas: cfg.replicas, key: cfg.key.clone() })
    }

    /// Connects, retrying with backoff (and saying so) until NATS answers. Callers
    /// that may give up drop the future.
    pub async fn connect_patiently(cfg: &NatsConfig) -> Bus {
        let mut wait = Duration::from_millis(200);
        loop {
            match Bus::connect(cfg).await {
                Ok(bus) => return bus,
                Err(e) => {
                    if let Some(quiet) = WAITING.say() {
                        tracing::warn!(error = %e, repeated = quiet, "waiting for NATS");
                    }
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MAX_RETRY);
        }
    }

    /// The NATS connection, for other subjects and streams (the River ingress).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub(crate) fn store(&self) -> &kv::Store {
        &self.store
    }

    /// Whether the connection to NATS is up now.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Opens the bucket again, creating it if it is gone (a NATS server restarted
    /// without its memory-backed streams). One try.
    pub async fn reopen(&mut self) -> Result<(), FleetError> {
        self.store = open_bucket(&self.client, self.replicas, Duration::ZERO).await?;
        Ok(())
    }

    /// Writes `rec` under its node's key.
    pub async fn put(&self, rec: &NodeRecord) -> Result<(), FleetError> {
        self.put_sealed(&key(&rec.node_id), seal::NODE, &rec.encode()).await
    }

    /// Writes `body` sealed for `label` under `key`.
    pub(crate) async fn put_sealed(&self, key: &str, label: &[u8], body: &[u8]) -> Result<(), FleetError> {
        let sealed = self.seal(label, body);
        self.store.put(key, sealed.into()).await.map_err(|e| FleetError::Bucket(e.to_string()))?;
        Ok(())
    }

    /// Removes a node's record (a clean stop).
    pub async fn remove(&self, id: &NodeId) -> Result<(), FleetError> {
        self.remove_key(&key(id)).await
    }

    pub(crate) async fn remove_key(&self, key: &str) -> Result<(), FleetError> {
        self.store.delete(key).await.map_err(|e| FleetError::Bucket(e.to_string()))
    }

    /// Every value under keys starting with `prefix` now that opens for `label`,
    /// parsed as `T`; the others are logged and left out.
    pub(crate) async fn values<T: serde::de::DeserializeOwned>(
        &self,
        prefix: &str,
        label: &[u8],
    ) -> Result<Vec<T>, FleetError> {
        use futures_util::TryStreamExt;
        let err = |e: &dyn std::fmt::Display| FleetError::Bucket(e.to_string());
        let keys: Vec<String> =
            self.store.keys().await.map_err(|e| err(&e))?.try_collect().await.map_err(|e| err(&e))?;
        let mut out = Vec::new();
        for k in keys.iter().filter(|k| k.starts_with(prefix)) {
            if let Some(v) = self.store.get(k).await.map_err(|e| err(&e))? {
                match self.open_as(label, &v) {
                    Ok(value) => out.push(value),
                    Err(e) => tracing::warn!(key = %k, error = %e, "ignoring a record"),
                }
            }
        }
        Ok(out)
    }

    /// Every record in the bucket now.
    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, FleetError> {
        let mut out: Vec<NodeRecord> = self.values(KEY_PREFIX, seal::NODE).await?;
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(out)
    }

    /// `body` sealed with this process's key (the insecure key without one).
    pub(crate) fn seal(&self, label: &[u8], body: &[u8]) -> Vec<u8> {
        seal::seal(self.key.as_ref().unwrap_or(&ClusterKey::insecure()), label, body)
    }

    /// A sealed value's body parsed as `T`, if it verifies (read unchecked without a key).
    pub(crate) fn open_as<T: serde::de::DeserializeOwned>(&self, label: &[u8], bytes: &[u8]) -> Result<T, String> {
        seal::open_as(self.key.as_ref(), label, bytes)
    }

    /// A node's record from its sealed value.
    pub(crate) fn record(&self, bytes: &[u8]) -> Result<NodeRecord, String> {
        self.open_as(seal::NODE, bytes)
    }

    /// Every change to the bucket from now on, after its current content.
    pub(crate) async fn watch(&self) -> Result<kv::Watch, FleetError> {
        self.store.watch_all().await.map_err(|e| FleetError::Bucket(e.to_string()))
    }
}

/// Every sealed JSON message on `subject` (wildcards allowed) from now on that
/// verifies for `label`, parsed as `T`, until the receiver is dropped. Core NATS: the client resubscribes by itself after
/// a reconnect, and what was published meanwhile is missed. A receiver `capacity`
/// behind loses messages rather than slowing the connection.
pub fn subscribe_sealed<T>(
    cfg: NatsConfig,
    subject: String,
    label: &'static [u8],
    capacity: usize,
) -> tokio::sync::mpsc::Receiver<T>
where
    T: serde::de::DeserializeOwned + Send + 'static,
{
    use futures_util::StreamExt;
    use tokio::sync::mpsc::error::TrySendError;
    let (tx, rx) = tokio::sync::mpsc::channel(capacity);
    tokio::spawn(async move {
        let bus = tokio::select! {
            bus = Bus::connect_patiently(&cfg) => bus,
            _ = tx.closed() => return,
        };
        let mut sub = match bus.client().subscribe(subject.clone()).await {
            Ok(s) => s,
            Err(e) => return tracing::error!(error = %e, subject, "cannot subscribe"),
        };
        while let Some(msg) = sub.next().await {
            match bus.open_as::<T>(label, &msg.payload) {
                Ok(m) => {
                    if let Err(TrySendError::Closed(_)) = tx.try_send(m) {
                        return;
                    }
                }
                Err(e) => tracing::warn!(error = %e, subject = %msg.subject, "a message ignored"),
            }
        }
    });
    rx
}

/// The node a bucket key names, if it names one.
pub(crate) fn node_of(key: &str) -> Option<NodeId> {
    key.strip_prefix(KEY_PREFIX)?.parse().ok()
}

pub(crate) fn key(id: &NodeId) -> String {
    format!("{KEY_PREFIX}{id}")
}

fn server_addrs(url: &str) -> Result<Vec<ServerAddr>, FleetError> {
    let bad = |why: String| FleetError::Url { url: url.to_string(), why };
    let addrs: Vec<ServerAddr> = url
        .split(',')
        .map(|s| s.trim().parse::<ServerAddr>().map_err(|e| bad(e.to_string())))
        .collect::<Result<_, _>>()?;
    if addrs.is_empty() {
        return Err(bad("no server given".into()));
    }
    Ok(addrs)
}

async fn options(cfg: &NatsConfig) -> Result<ConnectOptions, FleetError> {
    let mut opts = match &cfg.creds {
        Some(path) => ConnectOptions::with_credentials_file(path)
            .await
            .map_err(|source| FleetError::Creds { path: path.clone(), source })?,
        None => ConnectOptions::new(),
    };
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let (Some(user), Some(pass)) = (env("PDSERVE_NATS_USER"), env("PDSERVE_NATS_PASSWORD")) {
        opts = opts.user_and_password(user, pass);
    } else if let Some(token) = env("PDSERVE_NATS_TOKEN") {
        opts = opts.token(token);
    }
    if let Some(prefix) = env("PDSERVE_NATS_INBOX_PREFIX") {
        opts = opts.custom_inbox_prefix(prefix);
    }
    Ok(opts
        .event_callback(|event| async move { log_event(event) })
        .name(&cfg.client_name)
        .connection_timeout(CONNECT_TIMEOUT)
        // A lost server is noticed within seconds, and the client moves to another.
        .ping_interval(Duration::from_secs(2))
        .max_reconnects(None))
}

/// The client's connection events, in this process's log, one line per event of the
/// process: its connections (fleet records, traffic, KV events, the River) come up
/// and go down together with the server, and four lines for one event hid the rest.
/// (The client's own log lines are filtered out by default: connection errors reach
/// the caller as one error, and these say the rest once.)
fn log_event(event: async_nats::Event) {
    use async_nats::Event;
    match event {
        Event::Connected if !SAID_UP.swap(true, Ordering::Relaxed) => tracing::info!("NATS connected"),
        Event::Disconnected if SAID_UP.swap(false, Ordering::Relaxed) => {
            tracing::warn!("NATS disconnected; reconnecting")
        }
        Event::ClientError(e) => {
            if let Some(quiet) = CLIENT_ERRORS.say() {
                tracing::warn!(error = %e, repeated = quiet, "NATS client error")
            }
        }
        Event::ServerError(e) => {
            if let Some(quiet) = SERVER_ERRORS.say() {
                tracing::warn!(error = %e, repeated = quiet, "NATS server error")
            }
        }
        other => tracing::debug!(event = ?other, "NATS event"),
    }
}

/// Whether this process last said NATS is up.
static SAID_UP: AtomicBool = AtomicBool::new(false);
static WAITING: Repeats = Repeats::new();
static CLIENT_ERRORS: Repeats = Repeats::new();
static SERVER_ERRORS: Repeats = Repeats::new();
static NO_BUCKET: Repeats = Repeats::new();

/// How often a repeated warning of the process is said at most.
const REPEAT_EVERY: Duration = Duration::from_secs(30);

/// A warning that repeats while a condition lasts (NATS down: every connection of the
/// process retrying), said at most once per [`REPEAT_EVERY`] with how many times it
/// was not said since.
struct Repeats(Mutex<(Option<std::time::Instant>, u64)>);

impl Repeats {
    const fn new() -> Self {
        Repeats(Mutex::new((None, 0)))
    }

    /// `Some(not said since)` if the warning is to be said now.
    fn say(&self) -> Option<u64> {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = std::time::Instant::now();
        if s.0.is_some_and(|last| now - last < REPEAT_EVERY) {
            s.1 += 1;
            return None;
        }
        s.0 = Some(now);
        Some(std::mem::take(&mut s.1))
    }
}

/// Opens the bucket, creating it if missing. A bucket made by someone else (a
/// NimsForest bootstrap, say) is used with its own settings.
async fn open_bucket(client: &Client, replicas: usize, patience: Duration) -> Result<kv::Store, FleetError> {
    let js = jetstream::new(client.clone());
    let started = std::time::Instant::now();
    loop {
        if let Ok(store) = js.get_key_value(BUCKET).await {
            return Ok(store);
        }
        let config = kv::Config {
            bucket: BUCKET.into(),
            description: "pdserve nodes: one record per node, refreshed every second".into(),
            history: 1,
            max_age: TTL,
            storage: jetstream::stream::StorageType::Memory,
            num_replicas: replicas.max(1),
            ..Default::default()
        };
        match js.create_key_value(config).await {
            Ok(store) => return Ok(store),
            Err(e) if started.elapsed() >= patience => return Err(FleetError::Bucket(e.to_string())),
            Err(e) => {
                if let Some(quiet) = NO_BUCKET.say() {
                    tracing::info!(error = %e, repeated = quiet, "waiting for JetStream to create the fleet bucket");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}
