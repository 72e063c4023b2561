//! A stage group across processes: the head's [`RemoteStages`] (the engine's
//! [`NextStages`] over the stage data plane) and a later stage's [`StageService`] (a
//! [`StageRunner`] answering the head's calls). The calls, little-endian:
//!
//! ```text
//! hello: op 0                                   → first u32 | last u32 | layers u32 | hidden u32
//!                                                  | vocab u32 | blocks u32 | K/V port u32 (0: none)
//!                                                  | model name (UTF-8)
//! step:  op 1 | parts u32 | per part: rows u32 | start u32 | logits u32 | blocks u32 | ids u32…
//!             | residual stream f32… (rows × hidden)
//!                                               → compute ns u64 | the next residual stream, or (last
//!                                                 stage) the final residual rows that get logits on
//!                                                 the head
//! read:  op 2 | layer u32 | n u32 | block ids u32… → n u32 | n frames
//! write: op 3 | n u32 | n frames                   → (nothing)
//! tiers: op 4 | host slots u32 | disk slots u32 | n u32 | n copies → (nothing)
//! send:  op 5 | handoff u64 | token (16 bytes) | n u32 | block ids u32… | receivers (JSON)
//!                                               → status u8 (0 delivered, 1 unreachable,
//!                                                 2 failed) | why (UTF-8)
//! expect: op 6 | handoff u64 | n u32 | block ids u32… → token (16 bytes)
//! await:  op 7 | handoff u64                    → status u8 (0 every frame written, 2 failed) | why
//! forget: op 8 | handoff u64                    → (nothing)
//! frame: layer u32 | block u32 (read: its index) | dtype u8 | words u32 | K u16… | V u16…
//! copy:  from place | to place, each: tier u8 (0 pool, 1 host, 2 disk) | block or slot u32
//! ```
//!
//! A tiers call makes the head's lower-tier copies in the stage's layers before the
//! next call reads or writes a block (a block just handed out may be one evicted).
//!
//! A send has a prefill group's later stage send its own layers' K/V of a handoff to
//! the receiver itself, as a part of the handoff beside the head's sink (one link,
//! not two through the head); a stage that cannot reach the receiver sends nothing
//! and the head reads its layers instead. Reads move K/V out of a later stage (that
//! fallback, a peer's fetch) through the head.
//!
//! Into a decode group, a later stage with a K/V receiver of its own (its port in its
//! hello) takes its layers of a handoff straight from the sender: at the reservation
//! the head has it expect the handoff into the reserved blocks (it issues a token),
//! names it in the reservation, and before the sequence decodes awaits it; an import
//! given up is forgotten on the stages before its blocks are handed out again. Writes
//! carry the frames of a sender that sent them to the head.
//!
//! The head calls the stages one after the other (a star, not a ring): the stream goes
//! back to the head between stages, which costs one more hop per stage past the second
//! but keeps every stage a plain server. Micro-batches and lanes in flight do not wait
//! for the head to finish its own layers: between them it sends each answer that
//! arrived on to the next stage ([`NextStages::relay`]), so three stages compute at once.

use pdserve_engine::batch::{
    KvParts, NextStages, PartSent, PassTimes, StageCosts, StageLost, StagePart, StageRows, StageRunner, TierSlots,
};
use pdserve_engine::model::stage::covering;
use pdserve_engine::model::{LayerRange, Model};
use pdserve_kv::{BlockId, Move, Place};
use pdserve_kv_transfer::{ClusterKey, Frame, HandoffId, Inbox, Inboxes, KvSink, Links, StageConn, StageHandler};
use pdserve_types::{HandoffToken, KvAddr, KvDtype, KvFrame, StageCompute, StageReceiver, StageTotals};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

const HELLO: u8 = 0;
const STEP: u8 = 1;
const READ: u8 = 2;
const WRITE: u8 = 3;
const TIERS: u8 = 4;
const SEND: u8 = 5;
const EXPECT: u8 = 6;
const AWAIT: u8 = 7;
const FORGET: u8 = 8;
/// A stage's transfer that has not ended this long after it was expected is given
/// up (the head's own gives up sooner).
const IMPORT_TTL: Duration = Duration::from_secs(120);
/// How long a stage waits for a transfer's last frames when its head awaits it: well
/// inside the head's [`CALL_TIMEOUT`]. The head awaits once its own share is in, by
/// when the sender has finished every stage's.
const AWAIT_LIMIT: Duration = Duration::from_secs(20);
/// Blocks a read asks for in one call: its answer (a block of one layer is at most
/// 64 KiB for the models run here) stays far below a record's limit.
const READ_BLOCKS: usize = 256;
/// How long a head waits for one stage's answer to a step before it counts the stage
/// lost (a step of a large model on a slow host takes seconds; a dead host that sent
/// no reset is found this late).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a head whose stages are not all reachable tries them again.
const RETRY: Duration = Duration::from_millis(500);

/// What a stage says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageHello {
    pub layers: LayerRange,
    /// The model's: its layer count, hidden size, vocabulary, and name.
    pub total_layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Blocks of its K/V pool (at least the head's, whose ids it is sent).
    pub blocks: usize,
    /// The port its K/V receiver listens on (at the address the head dials it at);
    /// 0: it takes K/V only through its head.
    pub kv_port: u16,
    pub model: String,
}

impl StageHello {
    fn encode(&self) -> Vec<u8> {
        let l = &self.layers;
        let mut out = Vec::new();
        for v in [l.first, l.last, self.total_layers, self.hidden, self.vocab, self.blocks, self.kv_port.into()] {
            put_u32(&mut out, v);
        }
        out.extend_from_slice(self.model.as_bytes());
        out
    }

    fn decode(b: &[u8]) -> Result<StageHello, String> {
        let mut r = Reader(b);
        let (first, last) = (r.u32()?, r.u32()?);
        let (total_layers, hidden, vocab, blocks) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let kv_port = u16::try_from(r.u32()?).map_err(|_| "a hello's K/V port is out of range")?;
        let model = String::from_utf8_lossy(r.0).into_owned();
        Ok(StageHello { layers: LayerRange { first, last }, total_layers, hidden, vocab, blocks, kv_port, model })
    }

    /// Why a head of `head` cannot use this stage, if it cannot.
    pub fn mismatch(&self, head: &StageHello) -> Option<String> {
        let same = (self.total_layers, self.hidden, self.vocab) == (head.total_layers, head.hidden, head.vocab);
        if !same || self.model != head.model {
            return Some(format!(
                "the stage runs {} ({} layers, hidden {}, vocabulary {}), the head {} ({} layers, hidden {}, vocabulary {})",
                self.model, self.total_layers, self.hidden, self.vocab, head.model, head.total_layers, head.hidden, head.vocab
            ));
        }
        (self.blocks < head.blocks)
            .then(|| format!("the stage has {} KV blocks, fewer than the head's {}", self.blocks, head.blocks))
    }
}

fn put_u32(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u32).to_le_bytes());
}

/// Reads what a call or an answer holds, refusing short input.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u32(&mut self) -> Result<usize, String> {
        let (head, rest) = self.0.split_first_chunk::<4>().ok_or("a call cut short")?;
        self.0 = rest;
        Ok(u32::from_le_bytes(*head) as usize)
    }

    /// `n` block ids (of a call of `len` bytes).
    fn blocks(&mut self, n: usize, len: usize) -> Result<Vec<u32>, String> {
        if n > self.0.len() / 4 {
            return Err(format!("{n} blocks in a call of {len} bytes"));
        }
        (0..n).map(|_| self.u32().map(|b| b as u32)).collect()
    }

    fn u64(&mut self) -> Result<u64, String> {
        let (head, rest) = self.0.split_first_chunk::<8>().ok_or("an answer cut short")?;
        self.0 = rest;
        Ok(u64::from_le_bytes(*head))
    }

    fn floats(self, out: &mut Vec<f32>) -> Result<(), String> {
        if !self.0.len().is_multiple_of(4) {
            return Err("a residual stream of partial values".into());
        }
        out.clear();
        out.extend(self.0.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        Ok(())
    }
}

/// One frame, numbered by `block` (a block id, or its index within a read).
fn put_frame(out: &mut Vec<u8>, block: u32, f: &KvFrame) {
    put_u32(out, f.layer as usize);
    put_u32(out, block as usize);
    out.push(f.dtype.code());
    put_u32(out, f.k.len());
    for x in f.k.iter().chain(&f.v) {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

impl Reader<'_> {
    fn frames(&mut self) -> Result<Vec<(u32, KvFrame)>, String> {
        let n = self.u32()?;
        // Each frame takes 13 bytes at least: a count past that is a lie.
        if n > self.0.len() / 13 {
            return Err(format!("{n} frames in {} bytes", self.0.len()));
        }
        (0..n).map(|_| self.frame()).collect()
    }

    fn frame(&mut self) -> Result<(u32, KvFrame), String> {
        let (layer, block) = (self.u32()? as u32, self.u32()? as u32);
        let (&code, rest) = self.0.split_first().ok_or("a frame cut short")?;
        self.0 = rest;
        let dtype = KvDtype::from_code(code).ok_or_else(|| format!("a frame of K/V type {code}"))?;
        let words = self.u32()?;
        if words > self.0.len() / 4 {
            return Err(format!("a frame of {words} words in {} bytes", self.0.len()));
        }
        let (k, v) = (self.words(words), self.words(words));
        Ok((block, KvFrame { layer, index: block, dtype, k, v }))
    }

    fn words(&mut self, n: usize) -> Vec<u16> {
        let (head, rest) = self.0.split_at(n * 2);
        self.0 = rest;
        head.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
    }
}

fn put_place(out: &mut Vec<u8>, p: Place) {
    let (tier, at) = match p {
        Place::Device(b) => (0, b.0),
        Place::Host(s) => (1, s),
        Place::Disk(s) => (2, s),
    };
    out.push(tier);
    put_u32(out, at as usize);
}

impl Reader<'_> {
    fn place(&mut self) -> Result<Place, String> {
        let (&tier, rest) = self.0.split_first().ok_or("a copy cut short")?;
        self.0 = rest;
        let at = self.u32()? as u32;
        match tier {
            0 => Ok(Place::Device(BlockId(at))),
            1 => Ok(Place::Host(at)),
            2 => Ok(Place::Disk(at)),
            t => Err(format!("a copy to tier {t}")),
        }
    }

    /// A tiers call's slots and copies.
    fn copies(&mut self) -> Result<(TierSlots, Vec<Move>), String> {
        let slots = (self.u32()?, self.u32()?);
        let n = self.u32()?;
        // Each copy takes 10 bytes: a count past that is a lie.
        if n > self.0.len() / 10 {
            return Err(format!("{n} tier copies in {} bytes", self.0.len()));
        }
        let copies =
            (0..n).map(|_| Ok(Move { from: self.place()?, to: self.place()? })).collect::<Result<_, String>>()?;
        Ok((slots, copies))
    }
}

fn put_floats(out: &mut Vec<u8>, xs: &[f32]) {
    out.reserve(xs.len() * 4);
    for x in xs {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

fn encode_step(parts: &[StagePart], x: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.push(STEP);
    put_u32(out, parts.len());
    for p in parts {
        for v in [p.rows, p.start_pos, p.logits, p.blocks.len()] {
            put_u32(out, v);
        }
        p.blocks.iter().for_each(|&b| put_u32(out, b as usize));
    }
    put_floats(out, x);
}

/// A step call's parts and residual stream (`body` past its op byte).
fn decode_step(body: &[u8], x: &mut Vec<f32>) -> Result<Vec<StagePart>, String> {
    let mut r = Reader(body);
    let n = r.u32()?;
    // Each part takes 16 bytes at least: a count past that is a lie.
    if n > r.0.len() / 16 {
        return Err(format!("a step of {n} parts in {} bytes", body.len()));
    }
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        let (rows, start_pos, logits, n_blocks) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        if n_blocks > r.0.len() / 4 {
            return Err(format!("a part of {n_blocks} blocks in {} bytes", r.0.len()));
        }
        let blocks = (0..n_blocks).map(|_| r.u32().map(|b| b as u32)).collect::<Result<_, _>>()?;
        parts.push(StagePart { rows, start_pos, logits, blocks });
    }
    r.floats(x)?;
    Ok(parts)
}

/// A send's call: where the part goes, and the blocks.
fn encode_send(to: &KvParts, blocks: &[u32], out: &mut Vec<u8>) {
    out.push(SEND);
    out.extend_from_slice(&to.handoff.to_le_bytes());
    out.extend_from_slice(&to.token.0);
    put_u32(out, blocks.len());
    blocks.iter().for_each(|&b| put_u32(out, b as usize));
    // Addresses and tokens always serialize.
    let receivers = Receivers { to: to.to.clone(), stages: to.stages.clone() };
    out.extend_from_slice(serde_json::to_string(&receivers).unwrap_or_default().as_bytes());
}

/// A send's receivers: the handoff's main one, and a decode group's stages.
#[derive(serde::Serialize, serde::Deserialize)]
struct Receivers {
    to: KvAddr,
    #[serde(default)]
    stages: Vec<StageReceiver>,
}

fn decode_send(body: &[u8]) -> Result<(KvParts, Vec<u32>), String> {
    let mut r = Reader(body);
    let handoff = r.u64()?;
    let (token, rest) = r.0.split_first_chunk::<16>().ok_or("a send without its token")?;
    r.0 = rest;
    let n = r.u32()?;
    let blocks = r.blocks(n, body.len())?;
    let Receivers { to, stages } = serde_json::from_slice(r.0).map_err(|e| format!("a send's receivers: {e}"))?;
    Ok((KvParts { to, handoff, token: HandoffToken(*token), stages }, blocks))
}

fn put_sent(out: &mut Vec<u8>, sent: &PartSent) {
    let (status, why) = match sent {
        PartSent::Delivered => (0, ""),
        PartSent::Unreachable(why) => (1, why.as_str()),
        PartSent::Failed(why) => (2, why.as_str()),
    };
    out.push(status);
    out.extend_from_slice(why.as_bytes());
}

fn decode_sent(a: &[u8]) -> Result<PartSent, String> {
    let (&status, why) = a.split_first().ok_or("an empty answer to a send")?;
    let why = String::from_utf8_lossy(why).into_owned();
    match status {
        0 => Ok(PartSent::Delivered),
        1 => Ok(PartSent::Unreachable(why)),
        2 => Ok(PartSent::Failed(why)),
        s => Err(format!("a send answered with status {s}")),
    }
}

/// A later stage's side: its runner answers the head's calls.
pub struct StageService {
    /// Shared with the tasks that write a decode group's handoffs into its pool
    /// between the head's calls.
    runner: Arc<Mutex<StageRunner>>,
    hello: StageHello,
    x: Vec<f32>,
    /// Links to KV receivers, for its parts of a prefill group's handoffs; without
    /// them the head reads its layers.
    links: Option<Links>,
    /// Its own K/V receiver, for its layers of handoffs into a decode group; without
    /// it the head writes them.
    receiving: Option<Receiving>,
}

/// Frames a later stage's inbox of one handoff holds before its sender waits.
const STAGE_INBOX_FRAMES: usize = 256;

/// Inboxes for a later stage of `model`: peers prove `key`, and no frame is larger
/// than a block of one of its layers.
pub fn stage_inboxes(model: &Model, key: ClusterKey) -> Inboxes {
    let values = crate::frame_values(&model.cfg);
    Inboxes::guarded(STAGE_INBOX_FRAMES, key, pdserve_kv_transfer::frame::encoded_len_for(values))
}

/// A later stage's K/V receiver: the inboxes it delivers into, the runtime the
/// transfers run on, and the handoffs expected.
struct Receiving {
    inboxes: Inboxes,
    rt: tokio::runtime::Handle,
    imports: HashMap<u64, StageImport>,
}

/// One handoff a later stage expects: the task writing its frames into the pool,
/// and whether it still may.
struct StageImport {
    task: tokio::task::JoinHandle<Result<(), String>>,
    live: Arc<AtomicBool>,
}

impl StageImport {
    fn stop(self, runner: &Mutex<StageRunner>) {
        stop_writes(runner, &self.live, &self.task.abort_handle());
    }
}

/// Stops a transfer's writes: once this returns none lands (a write holds the
/// runner's lock, and looks at `live` under it).
fn stop_writes(runner: &Mutex<StageRunner>, live: &AtomicBool, task: &tokio::task::AbortHandle) {
    let _held = runner.lock().unwrap_or_else(PoisonError::into_inner);
    live.store(false, Ordering::SeqCst);
    task.abort();
}

impl StageService {
    pub fn new(runner: StageRunner, blocks: usize, model: String) -> StageService {
        let m = runner.model();
        let hello = StageHello {
            layers: m.layers(),
            total_layers: m.cfg.n_layers,
            hidden: m.cfg.hidden,
            vocab: m.cfg.vocab_size,
            blocks,
            kv_port: 0,
            model,
        };
        let runner = Arc::new(Mutex::new(runner));
        StageService { runner, hello, x: Vec::new(), links: None, receiving: None }
    }

    /// Sends its own layers of a handoff to receivers itself, over links proving the
    /// key `links` was made with.
    pub fn sending_parts(self, links: Links) -> StageService {
        StageService { links: Some(links), ..self }
    }

    /// Takes its layers of handoffs into its group straight from their senders, into
    /// `inboxes`, which a receiver listening on `port` (of the address its head dials)
    /// delivers into; the transfers run on `rt`.
    pub fn receiving(self, inboxes: Inboxes, port: u16, rt: tokio::runtime::Handle) -> StageService {
        let hello = StageHello { kv_port: port, ..self.hello };
        StageService { hello, receiving: Some(Receiving { inboxes, rt, imports: HashMap::new() }), ..self }
    }

    fn runner(&self) -> std::sync::MutexGuard<'_, StageRunner> {
        self.runner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends its layers' K/V of `blocks` (frames indexed from 0) as a part of its
    /// handoff: each layer to the receiver that takes it (a decode group's stage, or
    /// the main receiver); blocks while it connects and sends. A receiver it cannot
    /// reach before it opened any part makes it send nothing (the head sends its
    /// layers); after, the part fails.
    fn send_part(&mut self, to: &KvParts, blocks: &[u32]) -> PartSent {
        let Some(links) = &self.links else { return PartSent::Unreachable("this stage sends no parts".into()) };
        let id = HandoffId(to.handoff);
        let mut sinks: Vec<(KvAddr, Box<dyn KvSink>)> = Vec::new();
        for layer in self.hello.layers.indices() {
            let (addr, token) = to.route(layer as u32);
            if sinks.iter().any(|(a, _)| a == addr) {
                continue;
            }
            match links.open_part(addr, id, token) {
                Ok(sink) => sinks.push((addr.clone(), sink)),
                Err(e) if sinks.is_empty() => return PartSent::Unreachable(e.to_string()),
                Err(e) => return give_up(sinks, e.to_string()),
            }
        }
        for layer in self.hello.layers.indices() {
            let (addr, _) = to.route(layer as u32);
            let Some((_, sink)) = sinks.iter_mut().find(|(a, _)| a == addr) else { continue };
            let frames = self.runner().read_kv(layer, blocks);
            let sent = frames.and_then(|frames| {
                frames.into_iter().try_for_each(|f| sink.send(Frame::from_kv(id, f)).map_err(|e| e.to_string()))
            });
            if let Err(why) = sent {
                return give_up(sinks, why);
            }
        }
        let mut finished = sinks.into_iter();
        for (_, sink) in finished.by_ref() {
            if let Err(e) = sink.finish() {
                return give_up(finished.collect(), e.to_string());
            }
        }
        PartSent::Delivered
    }

    /// Expects its layers of handoff `handoff` into `blocks`: the token the sender
    /// presents.
    fn expect(&mut self, handoff: u64, blocks: Vec<u32>) -> Result<HandoffToken, String> {
        let Some(r) = self.receiving.as_mut() else { return Err("this stage takes K/V only through its head".into()) };
        if let Some(old) = r.imports.remove(&handoff) {
            old.stop(&self.runner);
            r.inboxes.forget(HandoffId(handoff));
        }
        let inbox = r.inboxes.expect(HandoffId(handoff)).map_err(|e| e.to_string())?;
        let token = inbox.token();
        let live = Arc::new(AtomicBool::new(true));
        let task = r.rt.spawn(write_arriving(inbox, self.runner.clone(), blocks, live.clone()));
        r.imports.insert(handoff, StageImport { task, live });
        Ok(token)
    }

    /// Waits (at most [`AWAIT_LIMIT`]) until every frame of `handoff` is written.
    fn await_import(&mut self, handoff: u64) -> PartSent {
        let Some(r) = self.receiving.as_mut() else { return PartSent::Failed("no K/V receiver".into()) };
        let Some(StageImport { task, live }) = r.imports.remove(&handoff) else {
            return PartSent::Failed(format!("handoff {handoff:x} is not expected here"));
        };
        let abort = task.abort_handle();
        let done = r.rt.block_on(async { tokio::time::timeout(AWAIT_LIMIT, task).await });
        match done {
            Ok(Ok(Ok(()))) => PartSent::Delivered,
            Ok(Ok(Err(why))) => PartSent::Failed(why),
            Ok(Err(e)) => PartSent::Failed(e.to_string()),
            Err(_) => {
                stop_writes(&self.runner, &live, &abort);
                PartSent::Failed("its frames did not all arrive in time".into())
            }
        }
    }

    /// Gives `handoff` up: no frame of it is written after this returns.
    fn forget(&mut self, handoff: u64) {
        let Some(r) = self.receiving.as_mut() else { return };
        if let Some(i) = r.imports.remove(&handoff) {
            i.stop(&self.runner);
        }
        r.inboxes.forget(HandoffId(handoff));
    }

    /// Gives every handoff up: a head that (re)connects knows of none.
    fn forget_all(&mut self) {
        let Some(r) = self.receiving.as_mut() else { return };
        for (h, i) in r.imports.drain() {
            i.stop(&self.runner);
            r.inboxes.forget(HandoffId(h));
        }
    }
}

/// Aborts the parts in `sinks`; the handoff fails.
fn give_up(sinks: Vec<(KvAddr, Box<dyn KvSink>)>, why: String) -> PartSent {
    sinks.into_iter().for_each(|(_, s)| s.abort());
    PartSent::Failed(why)
}

/// Writes the frames arriving in `inbox` into `blocks` (by their index) of the
/// runner's pool while `live`: `Ok` once every frame arrived.
async fn write_arriving(
    mut inbox: Inbox,
    runner: Arc<Mutex<StageRunner>>,
    blocks: Vec<u32>,
    live: Arc<AtomicBool>,
) -> Result<(), String> {
    let recycle = inbox.pool();
    let until = tokio::time::Instant::now() + IMPORT_TTL;
    loop {
        let f = match tokio::time::timeout_at(until, inbox.recv()).await {
            Err(_) => return Err("the K/V did not all arrive in time".into()),
            Ok(Err(e)) => return Err(e.to_string()),
            Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(f))) => f.into_kv(),
        };
        let Some(&block) = blocks.get(f.index as usize) else {
            return Err(format!("a frame of block {} of {}", f.index, blocks.len()));
        };
        {
            let mut r = runner.lock().unwrap_or_else(PoisonError::into_inner);
            if !live.load(Ordering::SeqCst) {
                return Err("given up".into());
            }
            r.write_kv(block, &f)?;
        }
        recycle.recycle(f.k, f.v);
    }
}

impl StageHandler for StageService {
    fn handle(&mut self, call: &[u8], reply: &mut Vec<u8>) -> Result<(), String> {
        match call.split_first() {
            Some((&HELLO, _)) => {
                self.forget_all();
                reply.extend_from_slice(&self.hello.encode());
            }
            Some((&STEP, body)) => {
                let parts = decode_step(body, &mut self.x)?;
                let started = Instant::now();
                let mut runner = self.runner.lock().unwrap_or_else(PoisonError::into_inner);
                let rows = match runner.run(&parts, &self.x)? {
                    StageRows::Hidden(h) | StageRows::Last(h) => h,
                };
                let ns = started.elapsed().as_nanos().min(u64::MAX as u128) as u64;
                reply.extend_from_slice(&ns.to_le_bytes());
                put_floats(reply, rows);
            }
            Some((&READ, body)) => {
                let mut r = Reader(body);
                let (layer, n) = (r.u32()?, r.u32()?);
                let blocks = r.blocks(n, body.len())?;
                let frames = self.runner().read_kv(layer, &blocks)?;
                put_u32(reply, frames.len());
                frames.iter().for_each(|f| put_frame(reply, f.index, f));
            }
            Some((&WRITE, body)) => {
                // Checked whole before any is written.
                let frames = Reader(body).frames()?;
                let mut runner = self.runner();
                frames.iter().try_for_each(|(b, f)| runner.write_kv(*b, f))?;
            }
            Some((&SEND, body)) => {
                let (to, blocks) = decode_send(body)?;
                let sent = self.send_part(&to, &blocks);
                put_sent(reply, &sent);
            }
            Some((&TIERS, body)) => {
                let (slots, copies) = Reader(body).copies()?;
                self.runner().copy_tiers(slots, &copies)?;
            }
            Some((&EXPECT, body)) => {
                let mut r = Reader(body);
                let (handoff, n) = (r.u64()?, r.u32()?);
                let blocks = r.blocks(n, body.len())?;
                reply.extend_from_slice(&self.expect(handoff, blocks)?.0);
            }
            Some((&AWAIT, body)) => {
                let sent = self.await_import(Reader(body).u64()?);
                put_sent(reply, &sent);
            }
            Some((&FORGET, body)) => self.forget(Reader(body).u64()?),
            _ => return Err("an unknown call".into()),
        }
        Ok(())
    }
}

/// One later stage as the head knows it.
struct Stage {
    addr: SocketAddr,
    conn: Option<StageConn>,
    /// Its layers, once it said hello.
    layers: Option<LayerRange>,
    /// Where it receives K/V itself, if it does: its hello's port at `addr`'s host.
    kv: Option<SocketAddr>,
}

/// The head's side: the later stages at their addresses, called in layer order.
pub struct RemoteStages {
    head: StageHello,
    stages: Vec<Stage>,
    key: ClusterKey,
    /// When reconnecting was last tried, and why the group is not whole.
    tried: Option<Instant>,
    /// Dials in flight, off the worker's loop: a host that is gone takes the connect
    /// timeout to say so.
    dialing: Option<std::thread::JoinHandle<Vec<Dialed>>>,
    /// When the connections were last looked at for a stage that closed.
    checked: Option<Instant>,
    missing: Option<String>,
    fresh: bool,
    call: Vec<u8>,
    x: Vec<f32>,
    totals: StageTotals,
    /// The stages' passes by their layers (the rows and the seconds each said it
    /// computed): kept across a stage that leaves and one that takes its place.
    passes: BTreeMap<(usize, usize), PassTimes>,
    /// Hops of a step's whole rows (the round trip less the stage's compute).
    hop: PassTimes,
    /// A step's micro-batches (or lanes) sent and not finished, oldest first, and what
    /// the head waited sending them.
    flights: Vec<Flight>,
    waited: f64,
    /// Never micro-batches ([`RemoteStages::whole_steps`]).
    whole_steps: bool,
    /// Where the stages are, when something finds them (the fleet) rather than being
    /// given once.
    finder: Option<Finder>,
}

/// A micro-batch in flight: its parts, and the stage whose answer to it is awaited.
/// Each stage answers in order, so an older flight is never behind a newer one.
struct Flight {
    parts: Vec<StagePart>,
    at: usize,
}

impl Flight {
    fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }
}

/// The later stages' addresses as they are found now.
pub type Finder = Box<dyn FnMut() -> Vec<SocketAddr> + Send>;

impl RemoteStages {
    /// The stages at `addrs` (any order), for a head that says `head` of itself.
    pub fn new(head: StageHello, addrs: &[SocketAddr], key: ClusterKey) -> RemoteStages {
        let stages = addrs.iter().map(|&addr| Stage { addr, conn: None, layers: None, kv: None }).collect();
        let missing = Some("not connected yet".into());
        let (call, x, totals) = (Vec::new(), Vec::new(), StageTotals::default());
        let (tried, dialing, checked, finder) = (None, None, None, None);
        let (passes, hop, flights) = (BTreeMap::new(), PassTimes::default(), Vec::new());
        RemoteStages {
            passes,
            hop,
            flights,
            waited: 0.0,
            whole_steps: false,
            head,
            stages,
            key,
            tried,
            dialing,
            checked,
            missing,
            fresh: false,
            call,
            x,
            totals,
            finder,
        }
    }

    /// Sends every step through the stages whole: no micro-batches, whatever the
    /// stages' costs (for comparison).
    pub fn whole_steps(mut self) -> RemoteStages {
        self.whole_steps = true;
        self
    }

    /// Takes the stages `finder` finds from now on, while the group is not whole: a
    /// new address is dialed, an unconnected one no longer found is forgotten (a
    /// connected one stays until it fails). A whole group takes no other stage.
    pub fn with_finder(mut self, finder: Finder) -> RemoteStages {
        self.finder = Some(finder);
        self
    }

    fn offer(&mut self, addrs: &[SocketAddr]) {
        self.stages.retain(|s| s.conn.is_some() || addrs.contains(&s.addr));
        for &addr in addrs {
            if !self.stages.iter().any(|s| s.addr == addr) {
                self.stages.push(Stage { addr, conn: None, layers: None, kv: None });
            }
        }
    }

    /// Why the group cannot serve now (`None` once every stage answered and their
    /// layers cover the model's with the head's).
    pub fn missing(&self) -> Option<&str> {
        self.missing.as_deref()
    }

    /// Connects to every stage not connected and checks the group: at once and
    /// waiting if `now`, else on a thread of its own at most once per [`RETRY`], its
    /// outcome taken by a later call.
    pub fn connect(&mut self, now: bool) -> Option<&str> {
        if let Some(done) = self.dialing.take_if(|d| now || d.is_finished()) {
            let dialed = done.join().unwrap_or_default();
            self.take(dialed);
        }
        if !now && self.checked.is_none_or(|t| t.elapsed() >= RETRY) {
            self.checked = Some(Instant::now());
            self.check_idle();
        }
        let whole = self.missing.is_none() && self.stages.iter().all(|s| s.conn.is_some());
        if let Some(found) = self.finder.as_mut().filter(|_| !whole).map(|f| f()) {
            self.offer(&found);
        }
        if whole || self.dialing.is_some() || (!now && self.tried.is_some_and(|t| t.elapsed() < RETRY)) {
            return self.missing();
        }
        self.tried = Some(Instant::now());
        let addrs: Vec<SocketAddr> = self.stages.iter().filter(|s| s.conn.is_none()).map(|s| s.addr).collect();
        let (key, head) = (self.key.clone(), self.head.clone());
        let dial = move || addrs.into_iter().map(|addr| (addr, hello(addr, &key, &head))).collect();
        match now {
            true => {
                let dialed = dial();
                self.take(dialed);
            }
            false => match std::thread::Builder::new().name("stage-dial".into()).spawn(dial) {
                Ok(handle) => self.dialing = Some(handle),
                Err(e) => self.missing = Some(format!("cannot dial the stages: {e}")),
            },
        }
        self.missing()
    }

    /// Loses every stage whose connection closed while the head was idle, so the group
    /// is out before a request is routed to it.
    fn check_idle(&mut self) {
        let closed: Vec<usize> = (0..self.stages.len())
            .filter(|&i| self.stages[i].conn.as_ref().is_some_and(StageConn::is_closed))
            .collect();
        for i in closed {
            let lost = self.lose(i, "it closed the connection".into());
            tracing::warn!(error = %lost, "stage group not whole");
        }
    }

    /// Takes what dialing the missing stages gave.
    fn take(&mut self, dialed: Vec<Dialed>) {
        let mut why = None;
        for (addr, got) in dialed {
            let Some(s) = self.stages.iter_mut().find(|s| s.addr == addr && s.conn.is_none()) else { continue };
            match got {
                Ok((conn, said)) => {
                    let kv = (said.kv_port != 0).then(|| SocketAddr::new(addr.ip(), said.kv_port));
                    (s.conn, s.layers, s.kv) = (Some(conn), Some(said.layers), kv);
                    self.fresh = true;
                }
                Err(e) => why = Some(format!("stage at {addr}: {e}")),
            }
        }
        self.missing = why.or_else(|| self.order());
    }

    /// Sorts the stages by layer; why their layers and the head's do not cover the
    /// model once each, if they do not.
    fn order(&mut self) -> Option<String> {
        self.stages.sort_by_key(|s| s.layers.map(|l| l.first));
        let mut ranges: Vec<LayerRange> = self.stages.iter().filter_map(|s| s.layers).collect();
        ranges.push(self.head.layers);
        match covering(&ranges, self.head.total_layers) {
            Some(_) => None,
            None => {
                let have: Vec<String> = ranges.iter().map(ToString::to_string).collect();
                Some(format!("layers {} do not cover 0..{} once each", have.join(", "), self.head.total_layers - 1))
            }
        }
    }

    fn lose(&mut self, i: usize, why: String) -> StageLost {
        // Nothing in flight outlives the connection it went on.
        self.flights.clear();
        let s = &mut self.stages[i];
        s.conn = None;
        let why = format!("stage at {} (layers {}): {why}", s.addr, s.layers.map_or("?".into(), |l| l.to_string()));
        self.missing = Some(why.clone());
        StageLost(why)
    }
}

impl RemoteStages {
    /// The stages that receive K/V themselves.
    fn receiving(&self) -> Vec<usize> {
        (0..self.stages.len()).filter(|&i| self.stages[i].kv.is_some()).collect()
    }

    /// Makes a call of `op` on one handoff in `self.call`.
    fn handoff_call(&mut self, op: u8, handoff: u64) {
        self.call.clear();
        self.call.push(op);
        self.call.extend_from_slice(&handoff.to_le_bytes());
    }

    /// Takes the micro-batches `flights` (each awaited at its stage) through every
    /// stage: each stage's answers read in order, each sent on to the next stage at
    /// once, the last stage's rows into `rows`.
    fn through(&mut self, flights: &mut [Flight], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let mut buf = std::mem::take(&mut self.x);
        rows.clear();
        let last = self.stages.len() - 1;
        for i in 0..=last {
            for f in flights.iter_mut().filter(|f| f.at == i) {
                self.forward(f, &mut buf)?;
                if i == last {
                    rows.extend_from_slice(&buf);
                }
            }
        }
        self.x = buf;
        Ok(())
    }

    /// Reads `f`'s answer from its stage into `buf` and sends it on to the next stage,
    /// if there is one.
    fn forward(&mut self, f: &mut Flight, buf: &mut Vec<f32>) -> Result<(), StageLost> {
        let compute = self.answer_stage(f.at, buf)?;
        self.computed(f.at, f.rows(), compute);
        self.totals.bytes += (8 + buf.len() * 4) as u64;
        f.at += 1;
        if f.at < self.stages.len() {
            encode_step(&f.parts, buf, &mut self.call);
            self.send_stage(f.at)?;
        }
        Ok(())
    }

    /// Loses every stage with answers still in flight after a failed step: they
    /// would answer the next one.
    fn drop_stale(&mut self) {
        let stale: Vec<usize> = (0..self.stages.len())
            .filter(|&i| self.stages[i].conn.as_ref().is_some_and(|c| c.in_flight() > 0))
            .collect();
        stale.into_iter().for_each(|i| drop(self.lose(i, "a step in micro-batches failed".into())));
    }

    /// Counts stage `i`'s compute on a pass of `rows` rows.
    fn computed(&mut self, i: usize, rows: usize, seconds: f64) {
        let l = self.stages[i].layers.map_or((0, 0), |l| (l.first, l.last));
        self.passes.entry(l).or_default().record(rows, seconds);
    }

    /// Counts a step of `rows` rows that the head waited `seconds` on.
    fn stepped(&mut self, rows: usize, seconds: f64) {
        self.totals.steps += 1;
        self.totals.rows += rows as u64;
        self.totals.seconds += seconds;
    }

    /// Sends the call in `self.call` to stage `i` without waiting; the stage is lost
    /// if it cannot be sent.
    fn send_stage(&mut self, i: usize) -> Result<(), StageLost> {
        let Some(conn) = self.stages[i].conn.as_mut() else { return Err(self.lose(i, "not connected".into())) };
        match conn.send(&self.call) {
            Ok(()) => {
                self.totals.bytes += self.call.len() as u64;
                Ok(())
            }
            Err(e) => Err(self.lose(i, e.to_string())),
        }
    }

    /// Stage `i`'s answer to its oldest call in flight into `out`: its compute seconds.
    fn answer_stage(&mut self, i: usize, out: &mut Vec<f32>) -> Result<f64, StageLost> {
        let Some(conn) = self.stages[i].conn.as_mut() else { return Err(self.lose(i, "not connected".into())) };
        let answered = conn.answer().map_err(|e| e.to_string()).and_then(|a| answer_of(a, out));
        answered.map_err(|why| self.lose(i, why))
    }

    /// The stage holding `layer`.
    fn holding(&mut self, layer: usize) -> Result<usize, StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        let holds = |s: &Stage| s.layers.is_some_and(|l| l.indices().contains(&layer));
        self.stages.iter().position(holds).ok_or_else(|| StageLost(format!("no stage holds layer {layer}")))
    }

    /// Sends the call made in `self.call` to stage `i` and reads its answer with
    /// `read`; the stage is lost if either fails.
    fn call_stage<T>(&mut self, i: usize, read: impl FnOnce(&[u8]) -> Result<T, String>) -> Result<T, StageLost> {
        let Some(conn) = self.stages[i].conn.as_mut() else { return Err(self.lose(i, "not connected".into())) };
        // Not counted in the activation bytes: K/V, not the residual stream.
        let answered = conn.call(&self.call).map_err(|e| e.to_string()).and_then(read);
        answered.map_err(|why| self.lose(i, why))
    }
}

/// A step's answer: the stage's compute seconds, and its rows into `out`.
fn answer_of(a: &[u8], out: &mut Vec<f32>) -> Result<f64, String> {
    let mut r = Reader(a);
    let compute = r.u64()? as f64 * 1e-9;
    r.floats(out)?;
    Ok(compute)
}

/// A stage's address and what dialing it gave.
type Dialed = (SocketAddr, Result<(StageConn, StageHello), String>);

/// Connects to a stage and reads its hello.
fn hello(addr: SocketAddr, key: &ClusterKey, head: &StageHello) -> Result<(StageConn, StageHello), String> {
    let mut conn = StageConn::connect(addr, key, CALL_TIMEOUT).map_err(|e| e.to_string())?;
    let said = StageHello::decode(conn.call(&[HELLO]).map_err(|e| e.to_string())?)?;
    match said.mismatch(head) {
        Some(why) => Err(why),
        None => Ok((conn, said)),
    }
}

impl NextStages for RemoteStages {
    fn run(&mut self, parts: &[StagePart], x: &[f32], rows: &mut Vec<f32>) -> Result<(), StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        let mut buf = std::mem::take(&mut self.x);
        let n = parts.iter().map(|p| p.rows).sum();
        let (started, mut computed) = (Instant::now(), 0.0);
        for i in 0..self.stages.len() {
            encode_step(parts, if i == 0 { x } else { &buf }, &mut self.call);
            let out = if i + 1 == self.stages.len() { &mut *rows } else { &mut buf };
            let sent = Instant::now();
            let compute = self.call_stage(i, |a| answer_of(a, out))?;
            self.hop.record(n, (sent.elapsed().as_secs_f64() - compute).max(0.0));
            self.computed(i, n, compute);
            computed += compute;
            self.totals.bytes += (self.call.len() + 8 + out.len() * 4) as u64;
        }
        self.x = buf;
        let waited = started.elapsed().as_secs_f64();
        self.totals.link += (waited - computed).max(0.0);
        self.stepped(n, waited);
        Ok(())
    }

    fn costs(&self) -> StageCosts {
        if self.whole_steps {
            return StageCosts::default();
        }
        let cost = |s: &Stage| s.layers.and_then(|l| self.passes.get(&(l.first, l.last))).and_then(PassTimes::cost);
        StageCosts { passes: self.stages.iter().map(cost).collect(), hop: self.hop.cost() }
    }

    fn start(&mut self, parts: &[StagePart], x: &[f32]) -> Result<(), StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        let started = Instant::now();
        encode_step(parts, x, &mut self.call);
        self.send_stage(0)?;
        self.flights.push(Flight { parts: parts.to_vec(), at: 0 });
        self.waited += started.elapsed().as_secs_f64();
        Ok(())
    }

    fn finish(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let started = Instant::now();
        let (mut flights, sending) = (std::mem::take(&mut self.flights), std::mem::take(&mut self.waited));
        if flights.is_empty() {
            return Ok(());
        }
        let finished = self.through(&mut flights, rows);
        if finished.is_err() {
            self.drop_stale();
        }
        finished?;
        let n = flights.iter().map(Flight::rows).sum();
        self.stepped(n, sending + started.elapsed().as_secs_f64());
        self.totals.pipelined += 1;
        Ok(())
    }

    fn finish_first(&mut self, rows: &mut Vec<f32>) -> Result<(), StageLost> {
        let started = Instant::now();
        if self.flights.is_empty() {
            return Err(StageLost("no lane in flight".into()));
        }
        let (mut first, sending) = (self.flights.remove(0), std::mem::take(&mut self.waited));
        let finished = self.through(std::slice::from_mut(&mut first), rows);
        if finished.is_err() {
            self.flights.clear();
            self.drop_stale();
        }
        finished?;
        self.stepped(first.rows(), sending + started.elapsed().as_secs_f64());
        self.totals.lanes += 1;
        Ok(())
    }

    /// Each stage's oldest flight that it has answered goes on to the next stage, so
    /// lanes flow stage to stage while the head computes.
    fn relay(&mut self) -> Result<(), StageLost> {
        // Called after every layer of the head's: a step sent whole has nothing to pass.
        if self.flights.is_empty() {
            return Ok(());
        }
        let last = self.stages.len().saturating_sub(1);
        let mut buf = std::mem::take(&mut self.x);
        let mut flights = std::mem::take(&mut self.flights);
        let mut relayed = Ok(());
        for i in 0..last {
            let Some(f) = flights.iter_mut().find(|f| f.at == i) else { continue };
            if self.stages[i].conn.as_ref().is_some_and(StageConn::answered) {
                relayed = self.forward(f, &mut buf);
                if relayed.is_err() {
                    break;
                }
            }
        }
        self.x = buf;
        match relayed {
            Ok(()) => self.flights = flights,
            Err(_) => self.drop_stale(),
        }
        relayed
    }

    fn reconnected(&mut self) -> bool {
        std::mem::take(&mut self.fresh)
    }

    fn read_kv(&mut self, layer: usize, blocks: &[u32]) -> Result<Vec<KvFrame>, StageLost> {
        let i = self.holding(layer)?;
        self.totals.kv_relayed_layers += 1;
        let mut out = Vec::with_capacity(blocks.len());
        for chunk in blocks.chunks(READ_BLOCKS) {
            self.call.clear();
            self.call.push(READ);
            put_u32(&mut self.call, layer);
            put_u32(&mut self.call, chunk.len());
            chunk.iter().for_each(|&b| put_u32(&mut self.call, b as usize));
            let base = out.len() as u32;
            let read = self.call_stage(i, |a| {
                let frames = Reader(a).frames()?;
                if frames.len() != chunk.len() || frames.iter().any(|(_, f)| f.layer as usize != layer) {
                    return Err(format!("a read of layer {layer} answered with other frames"));
                }
                Ok(frames.into_iter().map(|(index, f)| KvFrame { index: base + index, ..f }))
            })?;
            out.extend(read);
        }
        Ok(out)
    }

    fn send_kv(&mut self, blocks: &[u32], to: &KvParts) -> Result<Vec<(LayerRange, PartSent)>, StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        self.call.clear();
        encode_send(to, blocks, &mut self.call);
        // Sent to every stage before any answer is read: the parts go at once.
        for i in 0..self.stages.len() {
            let Some(conn) = self.stages[i].conn.as_mut() else { return Err(self.lose(i, "not connected".into())) };
            if let Err(e) = conn.send(&self.call) {
                return Err(self.lose(i, e.to_string()));
            }
        }
        let mut sent = Vec::with_capacity(self.stages.len());
        for i in 0..self.stages.len() {
            let Some(conn) = self.stages[i].conn.as_mut() else { return Err(self.lose(i, "not connected".into())) };
            let answered = conn.answer().map_err(|e| e.to_string()).and_then(decode_sent);
            let part = answered.map_err(|why| self.lose(i, why))?;
            self.totals.kv_parts += u64::from(part == PartSent::Delivered);
            if let Some(layers) = self.stages[i].layers {
                sent.push((layers, part));
            }
        }
        Ok(sent)
    }

    fn write_kv(&mut self, frames: &[(u32, KvFrame)]) -> Result<(), StageLost> {
        for i in 0..self.stages.len() {
            let Some(l) = self.stages[i].layers else { continue };
            let mine: Vec<&(u32, KvFrame)> =
                frames.iter().filter(|(_, f)| l.indices().contains(&(f.layer as usize))).collect();
            if mine.is_empty() {
                continue;
            }
            self.call.clear();
            self.call.push(WRITE);
            put_u32(&mut self.call, mine.len());
            mine.iter().for_each(|(b, f)| put_frame(&mut self.call, *b, f));
            self.call_stage(i, |_| Ok(()))?;
            self.totals.kv_written_frames += mine.len() as u64;
        }
        Ok(())
    }

    fn expect_kv(&mut self, handoff: u64, blocks: &[u32]) -> Result<Vec<StageReceiver>, StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        let mut receivers = Vec::new();
        for i in 0..self.stages.len() {
            let (Some(l), Some(kv)) = (self.stages[i].layers, self.stages[i].kv) else { continue };
            self.call.clear();
            self.call.push(EXPECT);
            self.call.extend_from_slice(&handoff.to_le_bytes());
            put_u32(&mut self.call, blocks.len());
            blocks.iter().for_each(|&b| put_u32(&mut self.call, b as usize));
            let token = self.call_stage(i, |a| {
                let token: [u8; 16] = a.try_into().map_err(|_| format!("an expect answered with {} bytes", a.len()))?;
                Ok(HandoffToken(token))
            })?;
            let (first, last) = (l.first as u32, l.last as u32);
            receivers.push(StageReceiver { first, last, to: KvAddr::Tcp(kv), token });
        }
        Ok(receivers)
    }

    fn await_kv(&mut self, handoff: u64) -> Result<Result<(), String>, StageLost> {
        let mut got = Ok(());
        for i in self.receiving() {
            self.handoff_call(AWAIT, handoff);
            match self.call_stage(i, decode_sent)? {
                PartSent::Delivered => {}
                PartSent::Failed(why) | PartSent::Unreachable(why) => got = got.and(Err(why)),
            }
        }
        self.totals.kv_direct += u64::from(got.is_ok());
        Ok(got)
    }

    fn forget_kv(&mut self, handoff: u64) -> Result<(), StageLost> {
        for i in self.receiving() {
            self.handoff_call(FORGET, handoff);
            self.call_stage(i, |_| Ok(()))?;
        }
        Ok(())
    }

    fn tiers(&mut self, slots: TierSlots, copies: &[Move]) -> Result<(), StageLost> {
        if let Some(why) = self.missing.clone() {
            return Err(StageLost(why));
        }
        self.call.clear();
        self.call.push(TIERS);
        for v in [slots.0, slots.1, copies.len()] {
            put_u32(&mut self.call, v);
        }
        for m in copies {
            put_place(&mut self.call, m.from);
            put_place(&mut self.call, m.to);
        }
        (0..self.stages.len()).try_for_each(|i| self.call_stage(i, |_| Ok(())))
    }

    fn ready(&mut self) -> bool {
        self.connect(false).is_none()
    }

    fn totals(&self) -> StageTotals {
        let compute = self.passes.iter().map(|(&(first, last), t)| StageCompute { first, last, seconds: t.seconds() });
        StageTotals { compute: compute.collect(), ..self.totals.clone() }
    }
}

#[cfg(test)]
mod tests;
