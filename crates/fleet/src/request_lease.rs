//! Which frontend runs a forest request (from the River or the Wind): the key
//! `req.<request_id>` in the bucket `INFER_REQ` is its lease.
//!
//! The runner writes `running <token>` (a token of its own), and writes it again
//! every [`RENEW_EVERY`] at the revision it last wrote, so a second writer shows as a
//! wrong revision; at the end it writes `done` (kept 24 h). A copy that finds the key
//! `running` waits, and takes it over only once the revision has stood still for
//! [`LEASE`], at the revision it saw: no clocks of two hosts are compared. A copy can
//! come from the forest publishing twice, or from JetStream redelivering a message
//! whose ack wait passed while it was still queued here; either way one runs.

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use std::future::Future;
use std::time::{Duration, Instant};

/// The bucket of running and finished request ids.
const BUCKET: &str = "INFER_REQ";
const DONE: &[u8] = b"done";
/// How often the runner renews its lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(3);
/// How long a lease may stand unrenewed before another frontend takes it: three
/// missed renewals.
pub const LEASE: Duration = Duration::from_secs(10);

/// `running` and a token no other claim shares (the clock stands in should the OS
/// generator fail: unique, if not secret).
fn fresh_token() -> Bytes {
    let n = getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    Bytes::from(format!("running {n:016x}"))
}

pub struct Leases {
    store: kv::Store,
}

/// This frontend's hold on one request: the token it wrote and the revision it last
/// wrote at.
pub struct Lease {
    key: String,
    token: Bytes,
    revision: u64,
}

pub enum Claim {
    /// This frontend runs it.
    Run(Lease),
    /// It finished before: this copy is dropped.
    Finished,
    /// The bucket cannot be read now: this copy comes back later.
    Unknown,
}

/// What renewing a lease found.
#[derive(Debug, PartialEq, Eq)]
pub enum Renewed {
    Held,
    /// Another frontend took it over: this one's answer is not sent.
    Lost,
    /// The bucket did not answer: still ours as far as anyone can tell.
    Unknown,
}

impl Leases {
    /// The bucket, made with `replicas` if it is not there yet.
    pub async fn open(js: &jetstream::Context, replicas: usize) -> Result<Leases, async_nats::Error> {
        let store = match js.get_key_value(BUCKET).await {
            Ok(store) => store,
            Err(_) => {
                js.create_key_value(kv::Config {
                    bucket: BUCKET.into(),
                    history: 1,
                    max_age: Duration::from_secs(24 * 3600),
                    storage: stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await?
            }
        };
        Ok(Leases { store })
    }

    /// Takes `key` if it was never taken (or was given back); `None` when another
    /// frontend holds it, it finished, or the bucket cannot tell.
    pub async fn try_claim(&self, key: &str) -> Option<Lease> {
        let token = fresh_token();
        let revision = self.store.create(key, token.clone()).await.ok()?;
        Some(Lease { key: key.into(), token, revision })
    }

    /// Takes `key`, waiting while another frontend holds a live lease on it, and
    /// calling `waiting` every [`RENEW_EVERY`] meanwhile (to keep the message).
    pub async fn claim<F: Future<Output = ()>>(&self, key: &str, mut waiting: impl FnMut() -> F) -> Claim {
        let mut still: Option<(u64, Instant)> = None;
        loop {
            let token = fresh_token();
            match self.store.create(key, token.clone()).await {
                Ok(revision) => return Claim::Run(Lease { key: key.into(), token, revision }),
                Err(e) if e.kind() != CreateErrorKind::AlreadyExists => return Claim::Unknown,
                Err(_) => {}
            }
            let entry = match self.store.entry(key).await {
                Ok(Some(e)) if e.operation == Operation::Put => e,
                Ok(_) => continue, // deleted since: create it
                Err(_) => return Claim::Unknown,
            };
            if entry.value.as_ref() == DONE {
                return Claim::Finished;
            }
            match still {
                Some((revision, since)) if revision == entry.revision && since.elapsed() >= LEASE => {
                    if let Ok(revision) = self.store.update(key, token.clone(), revision).await {
                        tracing::info!(key, "a lease stood still; taken over");
                        return Claim::Run(Lease { key: key.into(), token, revision });
                    }
                }
                Some((revision, _)) if revision == entry.revision => {}
                _ => still = Some((entry.revision, Instant::now())),
            }
            waiting().await;
            tokio::time::sleep(RENEW_EVERY).await;
        }
    }

    /// Writes the lease again at its revision.
    pub async fn renew(&self, lease: &mut Lease) -> Renewed {
        match self.store.update(&lease.key, lease.token.clone(), lease.revision).await {
            Ok(revision) => {
                lease.revision = revision;
                Renewed::Held
            }
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => self.recheck(lease).await,
            Err(_) => Renewed::Unknown,
        }
    }

    /// After a wrong revision: a write of ours whose answer was lost, or another
    /// frontend's.
    async fn recheck(&self, lease: &mut Lease) -> Renewed {
        match self.store.entry(&lease.key).await {
            Ok(Some(e)) if e.value == lease.token => {
                lease.revision = e.revision;
                Renewed::Held
            }
            Ok(_) => Renewed::Lost,
            Err(_) => Renewed::Unknown,
        }
    }

    /// Records the request finished: no copy runs it again.
    pub async fn finish(&self, mut lease: Lease) {
        let done = Bytes::from_static(DONE);
        let mut written = self.store.update(&lease.key, done.clone(), lease.revision).await;
        if matches!(&written, Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision)
            && self.recheck(&mut lease).await == Renewed::Held
        {
            written = self.store.update(&lease.key, done, lease.revision).await;
        }
        if let Err(e) = written {
            tracing::warn!(key = %lease.key, error = %e, "cannot record a finished request");
        }
    }

    /// Gives the request back unfinished, for its next delivery to take at once.
    pub async fn give_back(&self, lease: Lease) {
        if let Err(e) = self.store.delete_expect_revision(&lease.key, Some(lease.revision)).await {
            tracing::warn!(key = %lease.key, error = %e, "cannot give a request back");
        }
    }
}
