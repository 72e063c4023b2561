//! KV export and import, the engine half of disaggregated serving.
//!
//! A prefill engine runs a prompt and hands out its K/V as frames, one per (layer,
//! block), each layer's frames as soon as that layer is computed. A decode engine
//! reserves blocks first, writes frames straight into them, then continues decoding
//! as if it had prefilled the prompt itself. The numerics of both engines are the same
//! row-wise kernels, so the tokens are identical to one engine doing both.

use super::draft::DraftImport;
use super::{Engine, EngineError, Sequence, StepOutput, BLOCK_SIZE};
use crate::kvcache::{convert_block, KvStorage};
use crate::tiers::TierBytes;
use pdserve_kv::{block_hashes, BlockHash, BlockPool, BlockTable, ImmutableBlock, Place};
use pdserve_types::{KvDtype, KvFrame, RequestId, SamplingParams};

/// Blocks reserved on a decode engine for a transfer in flight.
pub struct KvImport {
    pub(crate) id: RequestId,
    prompt_len: usize,
    table: BlockTable,
    pub(crate) ids: Vec<u32>,
    /// The draft model's blocks for the prompt, where this engine drafts with one.
    draft: Option<DraftImport>,
    /// What the draft model's K/V of the prompt would save this engine, as the
    /// prefill side was told ([`Engine::draft_kv_worth`]; `None`: whatever it costs).
    draft_worth: Option<f64>,
    /// Frames of later stages' layers (a group's head), with their blocks, not yet
    /// sent to the stages, and their bytes.
    staged: Vec<(u32, KvFrame)>,
    staged_bytes: usize,
    /// A group's later stages take their own layers straight from the sender
    /// ([`Engine::expect_stage_kv`]).
    pub(crate) direct: bool,
}

/// Bytes of later stages' frames a group's head holds before it sends them on.
const STAGED_BYTES: usize = 8 << 20;

impl Engine {
    /// Prefills `prompt` alone, streaming its K/V through `on_frame` layer by layer
    /// (`on_frame` returning `false` stops the prefill at the next layer boundary),
    /// and returns the first sampled token. The prompt's full blocks stay in this
    /// engine's prefix cache. Sequences already here (a mixed worker's decodes)
    /// wait until it is done, their blocks and numerics untouched.
    pub fn prefill_export(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<StepOutput, EngineError> {
        self.prefill_export_to(id, prompt, params, 0, None, on_frame)
    }

    /// [`Engine::prefill_export`] of a prompt whose first `imported` tokens' K/V
    /// came into reservation `id` from a peer (as for [`Engine::add_imported`]):
    /// only the rest is computed, and every block of the prompt is sent. Refused,
    /// the reservation stays for the caller to abort.
    pub fn prefill_export_imported(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        imported: usize,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<StepOutput, EngineError> {
        self.prefill_export_to(id, prompt, params, imported, None, on_frame)
    }

    /// [`Engine::prefill_export`], or [`Engine::prefill_export_imported`] where
    /// `imported` > 0, for a receiver whose reservation said what the draft model's
    /// K/V of the prompt would save it (`draft_worth`, [`Engine::draft_kv_worth`]):
    /// with a draft model here, the prompt is computed in it and shipped only where
    /// that saving exceeds what the computing costs here (a cost not yet measured is
    /// paid, to measure it). `None`: this engine decides as for its own decodes.
    pub fn prefill_export_to(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        imported: usize,
        draft_worth: Option<f64>,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<StepOutput, EngineError> {
        let mut s = match imported {
            0 => {
                self.check_new(id, &prompt, &params)?;
                self.sequence(id, prompt, params)?
            }
            n => self.imported_sequence(id, prompt, params, n)?,
        };
        if let Some(worth) = draft_worth.filter(|_| self.has_draft_model()) {
            s.model_drafts = Some(self.draft_kv_pays(&s.tokens, worth, |d| d.lacks(&s)));
        }
        self.set_aside(|e| e.run_export(s, on_frame))
    }

    /// Whether computing the draft model's K/V of `prompt` here (its `lacks` tokens
    /// the draft pool does not cache) costs less than the `worth` a receiver put on
    /// it; yes while this engine has not measured the cost.
    fn draft_kv_pays(&self, prompt: &[u32], worth: f64, lacks: impl Fn(&super::draft::Drafter) -> usize) -> bool {
        let cost = match (self.drafter.as_ref(), self.timed_speculation()) {
            (Some(d), _) => d.prompt_cost().map(|c| c * lacks(d) as f64),
            (None, Some(t)) => Some(t.draft_prompt_seconds(0, prompt.len())),
            (None, None) => None,
        };
        let pays = cost.is_none_or(|c| worth > c);
        tracing::debug!(pays, worth_ms = worth * 1e3, cost_ms = cost.map(|c| c * 1e3), "draft K/V for a receiver");
        pays
    }

    /// What the draft model's K/V of a prompt of `prompt_len` tokens, reserved here
    /// as `id`, would save this engine's decodes, in seconds (`None`: whatever it
    /// costs, while the saving is unmeasured; 0 without a draft model, or with no
    /// room for it): what the reservation tells the prefill side.
    pub fn draft_kv_worth(&self, id: RequestId) -> Option<f64> {
        let imp = self.importing.iter().find(|i| i.id == id)?;
        imp.draft_worth
    }

    /// Runs `f` with the batch emptied, then puts the sequences back as they were:
    /// an exported prefill's steps carry that one sequence only, so its frames are
    /// all of its last chunk, and the sequences waiting meanwhile (each delayed by
    /// the prefill, as the router's cost of a remote prefill counts) keep their
    /// blocks. Nothing else touches the engine meanwhile: one thread owns it.
    fn set_aside<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        // A group's lane in flight lands first (its sequences are set aside too), and
        // what it sampled waits for the next step of the batch, not the export's.
        self.settle_lanes();
        let landed = self.take_landed();
        let (waiting, running) = (std::mem::take(&mut self.waiting), std::mem::take(&mut self.running));
        let stalled = self.stalled;
        let out = f(self);
        // The export's own sequence left the batch whichever way it ended.
        debug_assert!(self.waiting.is_empty() && self.running.is_empty());
        self.waiting.extend(waiting);
        self.running.extend(running);
        self.stalled = stalled;
        self.keep_landed(landed);
        out
    }

    /// Steps `s` alone until its first token, exporting its blocks layer by layer
    /// during its last chunk; then drops it, its full blocks left in the cache.
    fn run_export(
        &mut self,
        s: Sequence,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<StepOutput, EngineError> {
        let id = s.id;
        self.waiting.push_back(s);
        loop {
            let (mut stopped, mut blocks) = (false, Vec::new());
            let mut outs = self.step_with(&mut |l, stored, seqs| {
                for s in seqs.iter().filter(|s| s.last_chunk) {
                    stopped |=
                        !export_layer(l, stored.kv.dtype, s.blocks.iter().map(|&b| stored.kv.block(l, b)), on_frame);
                    blocks.clone_from(&s.blocks);
                }
                !stopped
            });
            if stopped {
                // The receiver is gone: stop at this layer boundary, free the blocks.
                self.cancel(id);
                return Err(EngineError::Cancelled);
            }
            if let Some(lost) = self.stage_lost() {
                let lost = lost.clone();
                self.cancel(id);
                return Err(EngineError::Stage(lost));
            }
            if let Some(first) = outs.pop() {
                let sent = self.export_stages(&blocks, on_frame).map(|sent| sent && self.export_draft(id, on_frame));
                self.cancel(id);
                return match sent? {
                    true => Ok(first),
                    false => Err(EngineError::Cancelled),
                };
            }
            // Nothing else runs on this thread while it exports, so a step that
            // found no block for it (reservations and the sequences set aside hold
            // them) would find none next time either.
            if !self.has_work() || self.stalled() {
                self.cancel(id);
                return Err(EngineError::NoBlocks);
            }
        }
    }

    /// After an exported prefill, sends the draft model's K/V of the prompt (computed
    /// beside the target's chunks, and finished here where the step's budget left
    /// some), numbered after the target's layers: the decode engine then drafts
    /// without computing the prompt again. False once the receiver is gone.
    fn export_draft(&mut self, id: RequestId, on_frame: &mut dyn FnMut(KvFrame) -> bool) -> bool {
        let total = self.total_layers();
        let Some(seq) = self.running.iter().position(|s| s.id == id) else { return true };
        if self.running[seq].model_drafts == Some(false) {
            // Not worth its compute (here, or to the receiver): none of it goes, and
            // the decode engine drafts it by lookup.
            return true;
        }
        let upto = self.running[seq].prompt_len;
        let Some(d) = self.drafter.as_mut() else {
            // A timed engine's worker prices the bytes a real one would send.
            if self.timed_speculation().is_some_and(|t| t.draft_step.is_some()) {
                self.draft_shipped += upto;
            }
            return true;
        };
        if !d.complete(self.isa, &self.pool, &mut self.running, seq, upto, self.cfg.max_batch_tokens) {
            // No room in the draft pool: none of it goes, as above.
            return true;
        }
        let sent = d.export(&self.running[seq], upto, total, on_frame);
        self.draft_shipped += if sent { upto } else { 0 };
        sent
    }

    /// Reserves blocks for a prompt of `prompt_len` tokens whose K/V will arrive as
    /// frames. Fails at once when the pool cannot hold them.
    pub fn reserve_import(&mut self, id: RequestId, prompt_len: usize) -> Result<(), EngineError> {
        self.reserve_import_after(id, prompt_len, &[])
    }

    /// [`Engine::reserve_import`] for a fetch of a prefix whose first tokens, `own`
    /// (whole blocks), this engine caches itself: their blocks are taken from its
    /// cache (copied back from a lower tier where need be), and the frames, numbered
    /// from 0, fill the blocks after them (a peer's [`Engine::export_cached`] with
    /// `skip` = `own.len()`). Fails with [`EngineError::NotCached`] when some of
    /// `own` is no longer cached here.
    pub fn reserve_import_after(&mut self, id: RequestId, prompt_len: usize, own: &[u32]) -> Result<(), EngineError> {
        if self.contains(id) {
            return Err(EngineError::Duplicate(id));
        }
        if own.len() > prompt_len || !own.len().is_multiple_of(BLOCK_SIZE) {
            return Err(EngineError::BadFrame(format!("{} tokens to keep of {prompt_len}", own.len())));
        }
        let kept = self.cached_chain(&whole_block_hashes(own, self.cfg.cache_salt));
        if kept.len() * BLOCK_SIZE != own.len() {
            return Err(EngineError::NotCached);
        }
        let mut table = BlockTable::with_prefix(&self.blocks, self.cfg.cache_salt, kept);
        table.ensure_capacity(prompt_len).map_err(|_| EngineError::NoBlocks)?;
        // The frames overwrite these blocks: evicted ones go down first.
        self.settle_moves();
        let ids = table.block_ids().into_iter().skip(own.len() / BLOCK_SIZE).map(|b| b.0).collect();
        // A peer's cached prefix comes without draft K/V; a prefill's may come with it.
        let draft = self.drafter.as_ref().filter(|_| own.is_empty()).and_then(|d| d.reserve(prompt_len));
        // A timed engine's draft model has no pool: it takes any prompt's.
        let timed = self.drafter.is_none() && self.has_draft_model();
        let draft_worth = match own.is_empty() && (draft.is_some() || timed) {
            true => self.drafts_worth(id, prompt_len),
            false => Some(0.0),
        };
        let (staged, staged_bytes) = (Vec::new(), 0);
        let direct = false;
        self.importing.push(KvImport { id, prompt_len, table, ids, draft, draft_worth, staged, staged_bytes, direct });
        Ok(())
    }

    /// Writes one frame into the reserved blocks of `id`. A frame of another dtype
    /// than this cache's (a peer configured apart) is converted on receipt.
    /// Frames numbered past the target's layers carry the draft model's K/V; where
    /// the draft pool had no room for them they are dropped (the draft model then
    /// computes the prompt here).
    /// A group's head holds its later stages' frames and sends them on in batches.
    pub fn import_frame(&mut self, id: RequestId, f: &KvFrame) -> Result<(), EngineError> {
        let total = self.total_layers();
        let at = self.importing.iter().position(|i| i.id == id).ok_or(EngineError::Unknown(id))?;
        let imp = &mut self.importing[at];
        let layer = f.layer as usize;
        if let Some(draft_layer) = layer.checked_sub(total) {
            return match (self.drafter.as_mut(), imp.draft.as_mut()) {
                (None, _) => Err(EngineError::BadFrame(format!("layer {layer} of {total}"))),
                (Some(_), None) => Ok(()),
                (Some(d), Some(imp)) => d.import_frame(imp, draft_layer, f).map_err(EngineError::BadFrame),
            };
        }
        let block = *imp
            .ids
            .get(f.index as usize)
            .ok_or_else(|| EngineError::BadFrame(format!("block index {} out of range", f.index)))?;
        if layer < self.kv.n_layers {
            return write_frame(&mut self.kv, layer, block, f).map_err(EngineError::BadFrame);
        }
        imp.staged.push((block, f.clone()));
        imp.staged_bytes += f.payload_bytes();
        match imp.staged_bytes >= STAGED_BYTES {
            true => self.send_staged(at),
            false => Ok(()),
        }
    }

    /// Sends import `at`'s frames held for later stages on to them.
    fn send_staged(&mut self, at: usize) -> Result<(), EngineError> {
        let imp = &mut self.importing[at];
        let staged = std::mem::take(&mut imp.staged);
        imp.staged_bytes = 0;
        self.import_stages(&staged)
    }

    /// Takes import `id` out of the transfers in flight, its later stages' frames
    /// sent on or received by them (refused, it is gone all the same: its blocks
    /// return to the pool, once no stage writes them).
    fn take_import(&mut self, id: RequestId) -> Result<KvImport, EngineError> {
        let at = self.importing.iter().position(|i| i.id == id).ok_or(EngineError::Unknown(id))?;
        let direct = self.importing[at].direct;
        let mut sent = self.send_staged(at);
        if direct {
            sent = match sent {
                Ok(()) => self.settle_stage_kv(id, false),
                Err(e) => self.settle_stage_kv(id, true).and(Err(e)),
            };
        }
        let imp = self.importing.swap_remove(at);
        sent.map(|()| imp)
    }

    /// Turns a completed import into a decoding sequence whose first generated token
    /// (sampled by the prefill side) is `first`. Returns whether the sequence goes on
    /// decoding: `false` when `first` already ends the request (the prefill side
    /// reported it as the last token), in which case the blocks are released.
    pub fn finish_import(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
    ) -> Result<bool, EngineError> {
        let at = self.importing.iter().position(|i| i.id == id).ok_or(EngineError::Unknown(id))?;
        if self.importing[at].prompt_len != prompt.len() {
            return Err(EngineError::BadFrame("prompt length differs from the reservation".into()));
        }
        let mut s = self.sequence(id, prompt, params)?;
        let imp = self.take_import(id)?;
        s.sampler.replay_draw();
        s.computed = s.prompt_len;
        let mut table = imp.table;
        table.commit(&s.tokens);
        s.table = Some(table);
        let declined = imp.draft.as_ref().is_some_and(|d| d.got_none());
        s.draft_kv = imp.draft.and_then(|d| d.finish(&s.tokens));
        // Shipped, its prompt's draft compute is paid; declined by the prefill side
        // (none of it came), it drafts by lookup; else (part of it lost, or no room
        // for it here) this engine decides. A timed engine ships no draft K/V: its
        // prefill side decided as `prefill_export_to` does, on the same profile.
        s.model_drafts = match (self.drafter.is_some(), self.has_draft_model()) {
            (true, _) if s.draft_kv.is_some() => Some(true),
            (true, _) if declined => Some(false),
            (false, true) => Some(imp.draft_worth.is_none_or(|w| self.draft_kv_pays(&s.tokens, w, |_| 0))),
            _ => None,
        };
        // Record the first token exactly as a local step would have.
        s.tokens.push(first);
        s.history.push(first);
        if s.constraint.as_mut().is_some_and(|c| !c.accept(first)) {
            return Err(EngineError::Grammar("the prefill side's first token breaks the grammar".into()));
        }
        if s.finish_reason(&self.eog, self.context_length()).is_some() {
            return Ok(false);
        }
        self.running.push(s);
        Ok(true)
    }

    /// Sends the K/V of `tokens`' whole blocks from token `skip` on (whole blocks;
    /// the receiver holds those before), as far as this engine caches them in a
    /// run (copied back first where the run continues in a lower tier; the skipped
    /// blocks are not looked at, so not copied back), through `on_frame` layer by
    /// layer: the first block sent is frame index 0. Nothing is computed and the
    /// batch is untouched. Returns the tokens sent, 0 when the block at `skip` is
    /// not cached; `on_frame` returning `false` stops it
    /// ([`EngineError::Cancelled`]). While a step runs, [`CachedKv::export`] serves
    /// the same without waiting for the step's end, except on a group's head, whose
    /// later stages' layers are read between steps only.
    pub fn export_cached(
        &mut self,
        tokens: &[u32],
        skip: usize,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<usize, EngineError> {
        let hashes = whole_block_hashes(tokens, self.cfg.cache_salt);
        // Held while the frames are copied out; dropped, they go back to the cache.
        // The skipped blocks are the receiver's: not even copied back here.
        let hits = self.cached_chain_from(&hashes, skip / BLOCK_SIZE);
        let sent = export_blocks(&self.kv, &hits, on_frame)?;
        // A group's head: its later stages' layers of the same blocks.
        let ids: Vec<u32> = hits.iter().map(|b| b.id().0).collect();
        match self.export_stages(&ids, on_frame)? {
            true => Ok(sent),
            false => Err(EngineError::Cancelled),
        }
    }

    /// [`Engine::step`], calling `between` after each layer with what the pool
    /// caches, so a peer's fetch ([`CachedKv::export`]) waits for one layer of the
    /// step, not all of it.
    pub fn step_serving(&mut self, between: &mut dyn FnMut(&CachedKv<'_>)) -> Vec<StepOutput> {
        let (blocks, salt) = (self.blocks.clone(), self.cfg.cache_salt);
        self.step_with(&mut |_, stored, _| {
            between(&CachedKv { blocks: &blocks, stored, salt });
            true
        })
    }

    /// What the pool caches, as a step's layers see it ([`Engine::step_serving`]):
    /// for a clock that models a step's layers without running them (the twin).
    pub fn cached_kv(&self) -> CachedKv<'_> {
        let stored = Stored { kv: &self.kv, tiers: self.tiers.as_ref() };
        CachedKv { blocks: &self.blocks, stored, salt: self.cfg.cache_salt }
    }

    /// Turns a completed import of the K/V of `prompt`'s first `imported` tokens (a
    /// peer's cached prefix, [`Engine::export_cached`]) into a waiting request that
    /// computes only the rest, as if those tokens were found in this engine's own
    /// prefix cache; their blocks enter it. Unused reserved blocks serve the rest.
    pub fn add_imported(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        imported: usize,
    ) -> Result<(), EngineError> {
        let s = self.imported_sequence(id, prompt, params, imported)?;
        self.waiting.push_back(s);
        Ok(())
    }

    /// The sequence of `prompt` whose first `imported` tokens' K/V are in
    /// reservation `id`, which it takes over (gone on a refusal too).
    fn imported_sequence(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        imported: usize,
    ) -> Result<Sequence, EngineError> {
        let imp = self.take_import(id)?;
        // The engine leaves a token to compute for the logits, and computes a prompt
        // asked for its logprobs or its embedding in full.
        let usable = match params.whole_prompt() {
            true => 0,
            false => prompt.len().saturating_sub(1) / BLOCK_SIZE * BLOCK_SIZE,
        };
        if !imported.is_multiple_of(BLOCK_SIZE) || imported > usable || imported > imp.prompt_len {
            return Err(EngineError::BadFrame(format!("{imported} imported tokens do not fit the request")));
        }
        self.check_new(id, &prompt, &params)?;
        let mut s = self.sequence(id, prompt, params)?;
        let mut table = imp.table;
        table.commit(&s.tokens[..imported]);
        s.computed = imported;
        s.cached_tokens = imported;
        s.table = Some(table);
        Ok(s)
    }

    /// Gives up a transfer; its blocks return to the pool.
    pub fn abort_import(&mut self, id: RequestId) -> bool {
        let Some(at) = self.importing.iter().position(|i| i.id == id) else { return false };
        if self.importing[at].direct {
            // Before its blocks go back: no stage may write them after. A lost stage
            // comes back empty, its prefix cache with it.
            let _ = self.settle_stage_kv(id, true);
        }
        self.importing.remove(at);
        true
    }
}

/// The K/V bytes an engine holds: its pool and its host tier, as a step's layers
/// see them.
#[derive(Clone, Copy)]
pub(crate) struct Stored<'a> {
    pub(crate) kv: &'a KvStorage,
    pub(crate) tiers: Option<&'a TierBytes>,
}

/// The prefix cache's blocks, readable between two layers of a step: a cached
/// block was completed by an earlier step in every layer, a step writes only the
/// blocks its own sequences were given, never a cached one, and the lower tiers
/// change only when blocks are allocated, before a step.
pub struct CachedKv<'a> {
    blocks: &'a BlockPool,
    stored: Stored<'a>,
    salt: u64,
}

/// Blocks read from disk by one export while a step runs, at most: each holds the
/// step up by its read (a block of the default model is 360 KiB over all layers),
/// and past this many the receiver computing the rest is the smaller cost to the
/// holder's running sequences.
const MID_STEP_DISK_BLOCKS: usize = 64;

/// Where one block a running step's export sends is read from.
enum Held<'a> {
    Pool(ImmutableBlock),
    /// Host RAM, read in place.
    Host(&'a TierBytes, u32),
    /// Read from disk for this export: every layer, as a slot holds them.
    Disk(Vec<u16>),
}

impl CachedKv<'_> {
    /// [`Engine::export_cached`] without copying anything back into the pool (that
    /// would take blocks from the running step): pool blocks and host-tier blocks
    /// read in place, disk-tier blocks read for the export (up to
    /// [`MID_STEP_DISK_BLOCKS`]; the run ends there).
    pub fn export(
        &self,
        tokens: &[u32],
        skip: usize,
        on_frame: &mut dyn FnMut(KvFrame) -> bool,
    ) -> Result<usize, EngineError> {
        let hashes = whole_block_hashes(tokens, self.salt);
        let Some(rest) = hashes.get(skip / BLOCK_SIZE..) else { return Ok(0) };
        let n = self.stored.kv.block_words();
        let run = self.cached_run(rest, n);
        let sent = (0..self.stored.kv.n_layers).all(|l| {
            let layers = run.iter().filter_map(|b| match b {
                Held::Pool(b) => Some(self.stored.kv.block(l, b.id().0)),
                Held::Host(tiers, slot) => tiers.host_layer(*slot, l, n),
                Held::Disk(values) => values.get(l * 2 * n..(l + 1) * 2 * n).map(|layer| layer.split_at(n)),
            });
            export_layer(l, self.stored.kv.dtype, layers, on_frame)
        });
        match sent {
            true => Ok(run.len() * BLOCK_SIZE),
            false => Err(EngineError::Cancelled),
        }
    }

    /// The blocks of `hashes`, from the first, as far as this engine holds them
    /// in a run, in any tier (blocks of `n` values a layer).
    fn cached_run(&self, hashes: &[BlockHash], n: usize) -> Vec<Held<'_>> {
        // The pool's part in one lookup; past it, block by block in any tier.
        let mut run: Vec<Held<'_>> = self.blocks.match_prefix(hashes).into_iter().map(Held::Pool).collect();
        let mut read = 0;
        for &h in &hashes[run.len()..] {
            if let Some(b) = self.blocks.match_prefix(&[h]).pop() {
                run.push(Held::Pool(b));
                continue;
            }
            let Some(tiers) = self.stored.tiers else { break };
            let held = match self.blocks.locate_lower(h) {
                Some((_, Place::Host(slot))) if tiers.host_layer(slot, 0, n).is_some() => Held::Host(tiers, slot),
                Some((_, Place::Disk(slot))) if read < MID_STEP_DISK_BLOCKS => {
                    read += 1;
                    match tiers.disk_slot(slot) {
                        Some(values) => Held::Disk(values),
                        None => break,
                    }
                }
                _ => break,
            };
            run.push(held);
        }
        run
    }
}

/// The chained hashes of `tokens`' whole blocks.
fn whole_block_hashes(tokens: &[u32], salt: u64) -> Vec<BlockHash> {
    block_hashes(&tokens[..tokens.len() / BLOCK_SIZE * BLOCK_SIZE], BLOCK_SIZE, salt)
}

/// Sends every layer of `hits`, layer by layer; the tokens they hold.
fn export_blocks(
    kv: &KvStorage,
    hits: &[ImmutableBlock],
    on_frame: &mut dyn FnMut(KvFrame) -> bool,
) -> Result<usize, EngineError> {
    let sent =
        (0..kv.n_layers).all(|l| export_layer(l, kv.dtype, hits.iter().map(|b| kv.block(l, b.id().0)), on_frame));
    match sent {
        true => Ok(hits.len() * BLOCK_SIZE),
        false => Err(EngineError::Cancelled),
    }
}

/// Writes frame `f` into `block` of layer `layer` of `kv`, converting a frame of
/// another dtype than the cache's (a peer configured apart).
pub(crate) fn write_frame(kv: &mut KvStorage, layer: usize, block: u32, f: &KvFrame) -> Result<(), String> {
    let bad = || format!("layer {} with {} {} words", f.layer, f.k.len(), f.dtype);
    if f.dtype == kv.dtype {
        let n = kv.block_words();
        if f.k.len() != n || f.v.len() != n {
            return Err(bad());
        }
        kv.set_block(layer, block, &f.k, &f.v);
    } else {
        let (k, v) = convert_block(kv.block_shape(), f.dtype, kv.dtype, &f.k, &f.v).ok_or_else(bad)?;
        kv.set_block(layer, block, &k, &v);
    }
    Ok(())
}

/// Sends layer `l`'s K and V of each block in order; false once the receiver
/// refuses a frame.
pub(crate) fn export_layer<'k>(
    l: usize,
    dtype: KvDtype,
    blocks: impl Iterator<Item = (&'k [u16], &'k [u16])>,
    on_frame: &mut dyn FnMut(KvFrame) -> bool,
) -> bool {
    blocks.enumerate().all(|(index, (k, v))| {
        on_frame(KvFrame { layer: l as u32, index: index as u32, dtype, k: k.to_vec(), v: v.to_vec() })
    })
}
