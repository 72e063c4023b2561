use super::*;

fn parts() -> Vec<StagePart> {
    vec![
        StagePart { rows: 3, start_pos: 0, logits: 1, blocks: vec![7] },
        StagePart { rows: 1, start_pos: 40, logits: 1, blocks: vec![2, 9, 4] },
    ]
}

#[test]
fn a_step_call_decodes_to_what_was_encoded() {
    let x: Vec<f32> = (0..4 * 5).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut call = Vec::new();
    encode_step(&parts(), &x, &mut call);
    assert_eq!(call[0], STEP);
    let mut got = Vec::new();
    assert_eq!(decode_step(&call[1..], &mut got).unwrap(), parts());
    assert_eq!(got, x);
}

#[test]
fn a_cut_or_lying_call_is_refused_without_a_panic() {
    let mut call = Vec::new();
    encode_step(&parts(), &[1.0; 8], &mut call);
    let mut x = Vec::new();
    // No cut decodes to the whole step: it is refused, or it has fewer values than
    // its rows need (which the runner refuses by count).
    for end in 1..call.len() {
        if let Ok(p) = decode_step(&call[1..end], &mut x) {
            assert!(p != parts() || x.len() < 8, "cut at {end}");
        }
    }
    // A count of parts or blocks past what the bytes could hold.
    let mut lie = vec![];
    put_u32(&mut lie, 1 << 30);
    assert!(decode_step(&lie, &mut x).is_err());
    let mut lie = vec![];
    for v in [1, 1, 0, 1, 1 << 30] {
        put_u32(&mut lie, v);
    }
    assert!(decode_step(&lie, &mut x).is_err());
}

fn hello(layers: LayerRange, blocks: usize) -> StageHello {
    StageHello { layers, total_layers: 30, hidden: 576, vocab: 49152, blocks, kv_port: 7002, model: "m.gguf".into() }
}

#[test]
fn a_stage_of_another_model_or_a_smaller_pool_does_not_join() {
    let head = hello(LayerRange { first: 0, last: 14 }, 100);
    let ok = hello(LayerRange { first: 15, last: 29 }, 100);
    assert_eq!(StageHello::decode(&ok.encode()).unwrap(), ok);
    assert_eq!(ok.mismatch(&head), None);
    let other = StageHello { model: "n.gguf".into(), ..ok.clone() };
    assert!(other.mismatch(&head).unwrap().contains("n.gguf"));
    let wider = StageHello { hidden: 1024, ..ok.clone() };
    assert!(wider.mismatch(&head).is_some());
    let small = hello(LayerRange { first: 15, last: 29 }, 99);
    assert!(small.mismatch(&head).unwrap().contains("fewer than the head's 100"));
}

fn frames() -> Vec<(u32, KvFrame)> {
    let f = |layer, block, dtype| {
        let k: Vec<u16> = (0..6).map(|i| (i * 1000 + layer) as u16).collect();
        let v = k.iter().map(|x| x ^ 0x8000).collect();
        (block, KvFrame { layer: layer as u32, index: block, dtype, k, v })
    };
    vec![f(12, 40, KvDtype::F16), f(13, 3, KvDtype::Q8_0)]
}

#[test]
fn frames_decode_to_what_was_encoded_and_a_cut_or_lie_is_refused() {
    let mut call = Vec::new();
    put_u32(&mut call, 2);
    frames().iter().for_each(|(b, f)| put_frame(&mut call, *b, f));
    assert_eq!(Reader(&call).frames().unwrap(), frames());
    for end in 0..call.len() {
        assert!(Reader(&call[..end]).frames().is_err(), "cut at {end}");
    }
    // More frames, or more words, than the bytes could hold.
    let mut lie = call.clone();
    lie[..4].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(Reader(&lie).frames().is_err());
    let mut lie = call.clone();
    lie[13..17].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(Reader(&lie).frames().is_err());
    // A K/V type nobody has.
    let mut lie = call;
    lie[12] = 200;
    assert!(Reader(&lie).frames().is_err());
}

/// Two later stages of the default model served on loopback, and a head's view of them.
fn served_stages() -> (RemoteStages, Vec<pdserve_kv_transfer::StageServer>) {
    served_stages_with(ClusterKey::random())
}

/// [`served_stages`] proving `key`, each stage sending its parts of a handoff over
/// links that prove it too.
fn served_stages_with(key: ClusterKey) -> (RemoteStages, Vec<pdserve_kv_transfer::StageServer>) {
    let (stages, servers, _) = served_group(key, &[(10, 19), (20, 29)], None);
    (stages, servers)
}

/// Later stages of the default model holding `ranges` (with the head's 0..9, the
/// model), each with a K/V receiver of its own on `rt` where one is given.
fn served_group(
    key: ClusterKey,
    ranges: &[(usize, usize)],
    rt: Option<tokio::runtime::Handle>,
) -> (RemoteStages, Vec<pdserve_kv_transfer::StageServer>, Vec<pdserve_kv_transfer::TcpReceiver>) {
    use pdserve_engine::config::ModelConfig;
    use pdserve_engine::format::gguf::GgufFile;
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("smollm2-135m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let mut receivers = Vec::new();
    let servers: Vec<_> = ranges
        .iter()
        .map(|&(first, last)| {
            let m = std::sync::Arc::new(Model::load_stage(&file, cfg.clone(), LayerRange { first, last }).unwrap());
            let inboxes = stage_inboxes(&m, key.clone());
            let runner = StageRunner::new(m, 8, KvDtype::F16, 1, 64);
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let mut service = StageService::new(runner, 8, "m".into()).sending_parts(Links::new(key.clone()));
            if let Some(rt) = &rt {
                let rx = rt.block_on(pdserve_kv_transfer::TcpReceiver::bind("127.0.0.1:0", inboxes.clone())).unwrap();
                service = service.receiving(inboxes, rx.local_addr().port(), rt.clone());
                receivers.push(rx);
            }
            pdserve_kv_transfer::StageServer::start(listener, key.clone(), service).unwrap()
        })
        .collect();
    let head = StageHello {
        layers: LayerRange { first: 0, last: 9 },
        total_layers: 30,
        hidden: cfg.hidden,
        vocab: cfg.vocab_size,
        blocks: 8,
        kv_port: 0,
        model: "m".into(),
    };
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.local_addr()).collect();
    let mut stages = RemoteStages::new(head, &addrs, key);
    assert_eq!(stages.connect(true), None);
    (stages, servers, receivers)
}

#[test]
fn a_step_in_micro_batches_over_the_wire_gives_the_whole_steps_rows() {
    let (mut stages, _servers) = served_stages();
    let h = 576;
    // Two sequences: 5 rows in block 0, 3 in block 1, each wanting its last row's logits.
    let part = |rows, start_pos, logits, b| StagePart { rows, start_pos, logits, blocks: vec![b] };
    let x: Vec<f32> = (0..8 * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
    let mut whole = Vec::new();
    stages.run(&[part(5, 0, 1, 0), part(3, 0, 1, 1)], &x, &mut whole).unwrap();
    assert_eq!(whole.len(), 2 * h);
    // The first sequence cut across the two micro-batches, as the head's plan cuts it.
    stages.start(&[part(3, 0, 0, 0)], &x[..3 * h]).unwrap();
    stages.start(&[part(2, 3, 1, 0), part(3, 0, 1, 1)], &x[3 * h..]).unwrap();
    let mut piped = Vec::new();
    stages.finish(&mut piped).unwrap();
    assert_eq!(piped, whole);
    let t = stages.totals();
    assert_eq!((t.steps, t.rows, t.pipelined), (2, 16, 1));
    assert_eq!(t.compute.len(), 2);
    // Both stages timed passes of two sizes (8 rows whole, 3 and 5 in micro-batches).
    assert!(stages.costs().passes.iter().all(Option::is_some));
    // The connections are clear for the next step.
    stages.run(&[part(1, 5, 1, 0)], &x[..h], &mut whole).unwrap();
}

/// A lane's part: `rows` rows from `start_pos` of the sequence in block `b`.
fn lane_part(rows: usize, start_pos: usize, b: u32) -> StagePart {
    StagePart { rows, start_pos, logits: 1, blocks: vec![b] }
}

/// Two sequences' prompts through `stages`, then their next rows in one step whole
/// (its final rows, returned), then the same rows started again as two lanes: the
/// input rows, 576 wide.
fn two_lanes_started(stages: &mut RemoteStages) -> (Vec<f32>, Vec<f32>) {
    let h = 576;
    let x: Vec<f32> = (0..10 * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
    let mut rows = Vec::new();
    stages.run(&[lane_part(5, 0, 0), lane_part(3, 0, 1)], &x[..8 * h], &mut rows).unwrap();
    let mut whole = Vec::new();
    stages.run(&[lane_part(1, 5, 0), lane_part(1, 3, 1)], &x[8 * h..], &mut whole).unwrap();
    stages.start(&[lane_part(1, 5, 0)], &x[8 * h..9 * h]).unwrap();
    stages.start(&[lane_part(1, 3, 1)], &x[9 * h..]).unwrap();
    (x, whole)
}

#[test]
fn lanes_over_the_wire_land_one_at_a_time_with_the_whole_steps_rows() {
    let (mut stages, _servers) = served_stages();
    let h = 576;
    // Both lanes in flight, then landed oldest first.
    let (x, mut whole) = two_lanes_started(&mut stages);
    let (mut first, mut second) = (Vec::new(), Vec::new());
    stages.finish_first(&mut first).unwrap();
    assert_eq!(first, whole[..h]);
    stages.finish_first(&mut second).unwrap();
    assert_eq!(second, whole[h..]);
    assert!(stages.finish_first(&mut second).is_err(), "no lane left in flight");
    let t = stages.totals();
    assert_eq!((t.steps, t.lanes), (4, 2));
    // The connections are clear for the next step.
    stages.run(&[lane_part(1, 6, 0)], &x[..h], &mut whole).unwrap();
}

#[test]
fn lanes_go_on_stage_to_stage_while_the_head_computes() {
    let (mut stages, _servers) = served_stages();
    let h = 576;
    let (x, mut whole) = two_lanes_started(&mut stages);
    // The head relays between its layers, never waiting: both lanes reach the last
    // stage with no call from the head to land them.
    let deadline = Instant::now() + Duration::from_secs(20);
    while stages.flights.iter().any(|f| f.at == 0) {
        assert!(Instant::now() < deadline, "a lane stayed at the first stage");
        stages.relay().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut first, mut second) = (Vec::new(), Vec::new());
    stages.finish_first(&mut first).unwrap();
    stages.finish_first(&mut second).unwrap();
    assert_eq!((first.as_slice(), second.as_slice()), (&whole[..h], &whole[h..]));
    // Nothing is left to relay, and the connections are clear for the next step.
    stages.relay().unwrap();
    stages.run(&[lane_part(1, 6, 0)], &x[..h], &mut whole).unwrap();
}

#[test]
fn tier_copies_decode_to_what_was_encoded_and_a_cut_or_lie_is_refused() {
    let copies = [
        Move { from: Place::Device(BlockId(3)), to: Place::Host(1) },
        Move { from: Place::Host(1), to: Place::Disk(7) },
        Move { from: Place::Disk(7), to: Place::Device(BlockId(5)) },
    ];
    let mut call = Vec::new();
    for v in [2, 8, copies.len()] {
        put_u32(&mut call, v);
    }
    for m in &copies {
        put_place(&mut call, m.from);
        put_place(&mut call, m.to);
    }
    assert_eq!(Reader(&call).copies().unwrap(), ((2, 8), copies.to_vec()));
    for end in 0..call.len() {
        assert!(Reader(&call[..end]).copies().is_err(), "cut at {end}");
    }
    let mut lie = call.clone();
    lie[8..12].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(Reader(&lie).copies().is_err(), "more copies than bytes");
    let mut lie = call;
    lie[12] = 9;
    assert!(Reader(&lie).copies().is_err(), "a tier nobody has");
}

#[test]
fn a_block_sent_down_the_tiers_comes_back_whole_over_the_wire() {
    let (mut stages, _servers) = served_stages();
    let h = 576;
    let x: Vec<f32> = (0..4 * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
    let mut rows = Vec::new();
    let part = StagePart { rows: 4, start_pos: 0, logits: 1, blocks: vec![2] };
    stages.run(&[part], &x, &mut rows).unwrap();
    let before: Vec<Vec<KvFrame>> = [10, 25].iter().map(|&l| stages.read_kv(l, &[2]).unwrap()).collect();
    // Down to the host tier, on to disk; block 2 written over; back from disk into 6.
    let down = [
        Move { from: Place::Device(BlockId(2)), to: Place::Host(0) },
        Move { from: Place::Host(0), to: Place::Disk(1) },
    ];
    stages.tiers((1, 2), &down).unwrap();
    let part = StagePart { rows: 4, start_pos: 0, logits: 1, blocks: vec![2] };
    let other: Vec<f32> = x.iter().map(|v| -v).collect();
    stages.run(&[part], &other, &mut rows).unwrap();
    assert_ne!(stages.read_kv(10, &[2]).unwrap(), before[0]);
    stages.tiers((1, 2), &[Move { from: Place::Disk(1), to: Place::Device(BlockId(6)) }]).unwrap();
    for (l, want) in [10, 25].into_iter().zip(&before) {
        let back = stages.read_kv(l, &[6]).unwrap();
        assert_eq!((&back[0].k, &back[0].v), (&want[0].k, &want[0].v), "layer {l}");
    }
    // A copy past the slots, or up from disk to the host tier, is refused: the stage
    // is lost, nothing is copied.
    let past = Move { from: Place::Device(BlockId(2)), to: Place::Host(1) };
    assert!(stages.tiers((1, 2), &[past]).is_err());
    let (mut stages, _servers) = served_stages();
    let up = Move { from: Place::Disk(1), to: Place::Host(0) };
    assert!(stages.tiers((1, 2), &[up]).is_err());
}

#[test]
fn a_send_call_decodes_to_what_was_encoded_and_a_cut_or_lie_is_refused() {
    let stage = StageReceiver {
        first: 6,
        last: 17,
        to: KvAddr::Tcp("10.0.0.3:7001".parse().unwrap()),
        token: HandoffToken([4; 16]),
    };
    let to = KvParts {
        to: KvAddr::Tcp("10.0.0.2:7001".parse().unwrap()),
        handoff: 77,
        token: HandoffToken([9; 16]),
        stages: vec![stage],
    };
    let mut call = Vec::new();
    encode_send(&to, &[4, 0, 31], &mut call);
    assert_eq!(call[0], SEND);
    let (got, blocks) = decode_send(&call[1..]).unwrap();
    assert_eq!((&got.to, got.handoff, got.token, blocks), (&to.to, 77, to.token, vec![4, 0, 31]));
    assert_eq!(got.stages, to.stages);
    // Each layer goes where the decode group holds it.
    assert_eq!(got.route(5), (&to.to, to.token));
    assert_eq!(got.route(6), (&to.stages[0].to, to.stages[0].token));
    assert_eq!(got.route(18), (&to.to, to.token));
    for end in 1..call.len() {
        assert!(decode_send(&call[1..end]).is_err(), "cut at {end}");
    }
    let mut lie = call[1..].to_vec();
    lie[24..28].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(decode_send(&lie).is_err());
    for sent in [PartSent::Delivered, PartSent::Unreachable("no".into()), PartSent::Failed("gone".into())] {
        let mut a = Vec::new();
        put_sent(&mut a, &sent);
        assert_eq!(decode_sent(&a).unwrap(), sent);
    }
    assert!(decode_sent(&[]).is_err() && decode_sent(&[3]).is_err());
}

/// Later stages send their own layers of a handoff to its receiver, as parts beside
/// the head's sink: the receiver's inbox holds what reading them through the head
/// gives. A receiver the stages cannot reach, they say so and send nothing; one that
/// refuses the part fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_stages_send_their_layers_of_a_handoff_to_its_receiver_themselves() {
    use pdserve_kv_transfer::{Inboxes, TcpReceiver};
    let key = ClusterKey::random();
    let inboxes = Inboxes::guarded(1024, key.clone(), pdserve_kv_transfer::frame::MAX_FRAME_BYTES);
    let receiver = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
    let mut inbox = inboxes.expect(HandoffId(5)).unwrap();
    let (addr, token) = (KvAddr::Tcp(receiver.local_addr()), inbox.token());
    let sent = tokio::task::spawn_blocking(move || {
        let (mut stages, servers) = served_stages_with(key.clone());
        // A prompt of 5 rows in block 3 gives the stages' layers K/V to send.
        let x: Vec<f32> = (0..5 * 576).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let mut rows = Vec::new();
        stages.run(&[StagePart { rows: 5, start_pos: 0, logits: 1, blocks: vec![3] }], &x, &mut rows).unwrap();
        let main = Links::new(key).open(&pdserve_types::KvTarget::Remote(addr.clone()), HandoffId(5), token);
        let parts = KvParts { to: addr, handoff: 5, token, stages: Vec::new() };
        let sent = stages.send_kv(&[3], &parts).unwrap();
        main.unwrap().finish().unwrap();
        let through: Vec<KvFrame> = (10..30).flat_map(|l| stages.read_kv(l, &[3]).unwrap()).collect();
        let nobody = KvParts { to: KvAddr::Tcp("127.0.0.1:1".parse().unwrap()), ..parts.clone() };
        let unreachable = stages.send_kv(&[3], &nobody).unwrap();
        let refused = stages.send_kv(&[3], &KvParts { token: HandoffToken([0; 16]), ..parts }).unwrap();
        drop(servers);
        (sent, through, unreachable, refused)
    });
    let mut arrived = Vec::new();
    while let Some(f) = inbox.recv().await.unwrap() {
        arrived.push(f.into_kv());
    }
    let (sent, through, unreachable, refused) = sent.await.unwrap();
    let ranges = [LayerRange { first: 10, last: 19 }, LayerRange { first: 20, last: 29 }];
    assert_eq!(sent, ranges.map(|r| (r, PartSent::Delivered)));
    arrived.sort_by_key(|f| f.layer);
    assert_eq!(arrived, through, "the parts' frames are not what the head reads");
    assert!(unreachable.iter().all(|(_, s)| matches!(s, PartSent::Unreachable(_))), "{unreachable:?}");
    assert!(refused.iter().all(|(_, s)| matches!(s, PartSent::Failed(_))), "{refused:?}");
}

/// A decode group's later stages take their own layers of a handoff straight from
/// the sender (here a prefill group's stages, cut elsewhere: one of them sends to
/// both): what the prefill side holds lands in the blocks the decode head reserved,
/// on the stage that holds each layer, and the head's inbox gets none of it. A
/// handoff forgotten takes no frame after; one whose sender gave up fails its await.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_groups_stages_take_their_layers_straight_from_the_sender() {
    use pdserve_kv_transfer::{Inboxes, TcpReceiver};
    use pdserve_types::KvTarget;
    let key = ClusterKey::random();
    let rt = tokio::runtime::Handle::current();
    let head_inboxes = Inboxes::guarded(1024, key.clone(), pdserve_kv_transfer::frame::MAX_FRAME_BYTES);
    let head_rx = TcpReceiver::bind("127.0.0.1:0", head_inboxes.clone()).await.unwrap();
    let mut head_in = head_inboxes.expect(HandoffId(9)).unwrap();
    let (head_addr, head_token) = (KvAddr::Tcp(head_rx.local_addr()), head_in.token());
    let out = tokio::task::spawn_blocking(move || {
        let (mut p, _p) = served_stages_with(key.clone());
        let (mut d, _d, _rx) = served_group(key.clone(), &[(10, 14), (15, 29)], Some(rt));
        // A prompt of 5 rows in the prefill side's block 3.
        let x: Vec<f32> = (0..5 * 576).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        p.run(&[StagePart { rows: 5, start_pos: 0, logits: 1, blocks: vec![3] }], &x, &mut Vec::new()).unwrap();
        let receivers = d.expect_kv(9, &[5]).unwrap();
        let ranges: Vec<(u32, u32)> = receivers.iter().map(|r| (r.first, r.last)).collect();
        assert_eq!(ranges, [(10, 14), (15, 29)]);
        // The prefill head's sinks: to the decode head and each decode stage (its own
        // layers, none past 9 here, would go in them).
        let links = Links::new(key);
        let open = |to: &KvAddr, token| links.open(&KvTarget::Remote(to.clone()), HandoffId(9), token).unwrap();
        let mains: Vec<_> = receivers.iter().map(|r| open(&r.to, r.token)).collect();
        let head_main = open(&head_addr, head_token);
        let parts = KvParts { to: head_addr, handoff: 9, token: head_token, stages: receivers };
        let sent = p.send_kv(&[3], &parts).unwrap();
        mains.into_iter().for_each(|m| m.finish().unwrap());
        head_main.finish().unwrap();
        let awaited = d.await_kv(9).unwrap();
        let want: Vec<KvFrame> = (10..30).flat_map(|l| p.read_kv(l, &[3]).unwrap()).collect();
        let got: Vec<KvFrame> = (10..30).flat_map(|l| d.read_kv(l, &[5]).unwrap()).collect();

        let block6 = |d: &mut RemoteStages| (10..30).flat_map(|l| d.read_kv(l, &[6]).unwrap()).collect::<Vec<_>>();
        let before = block6(&mut d);
        let forgotten = d.expect_kv(10, &[6]).unwrap();
        d.forget_kv(10).unwrap();
        let late = KvParts { handoff: 10, stages: forgotten, ..parts.clone() };
        let late = p.send_kv(&[3], &late).unwrap();
        let after = block6(&mut d);

        let abandoned = d.expect_kv(11, &[7]).unwrap();
        abandoned.iter().for_each(|r| {
            links.open(&KvTarget::Remote(r.to.clone()), HandoffId(11), r.token).unwrap().abort();
        });
        let failed = d.await_kv(11).unwrap();
        (sent, awaited, (want, got), (before, after, late), failed, d.totals().kv_direct)
    });
    assert_eq!(head_in.recv().await.unwrap().map(|f| f.layer), None, "a layer past the head's came to it");
    let (sent, awaited, (want, got), (before, after, late), failed, direct) = out.await.unwrap();
    assert!(sent.iter().all(|(_, s)| *s == PartSent::Delivered), "{sent:?}");
    assert_eq!(awaited, Ok(()));
    assert_eq!(got, want, "the decode stages do not hold what the prefill stages computed");
    assert!(late.iter().all(|(_, s)| *s != PartSent::Delivered), "{late:?}");
    assert_eq!(after, before, "a forgotten handoff wrote its block");
    assert!(failed.is_err(), "an abandoned handoff awaited well");
    assert_eq!(direct, 1);
}
