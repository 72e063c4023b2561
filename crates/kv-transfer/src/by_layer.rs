//! One handoff sent to several receivers by layer: a decode group's later stages
//! take their own layers straight from the sender, the group's head the rest.

use crate::{Frame, KvSink, TransferError};
use std::ops::RangeInclusive;

/// A sink that sends each frame to the receiver of its layer: one of `stages` where
/// its range holds the layer, else `main`. It finishes the stages' sinks first, so
/// that once the main receiver has every frame, so has every stage.
pub struct ByLayer {
    main: Box<dyn KvSink>,
    stages: Vec<(RangeInclusive<u32>, Box<dyn KvSink>)>,
}

impl ByLayer {
    pub fn new(main: Box<dyn KvSink>, stages: Vec<(RangeInclusive<u32>, Box<dyn KvSink>)>) -> ByLayer {
        ByLayer { main, stages }
    }

    fn sink_of(&mut self, layer: u32) -> &mut Box<dyn KvSink> {
        match self.stages.iter_mut().find(|(r, _)| r.contains(&layer)) {
            Some((_, s)) => s,
            None => &mut self.main,
        }
    }
}

impl KvSink for ByLayer {
    fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        self.sink_of(frame.layer).send(frame)
    }

    fn send_returning(&mut self, frame: Frame) -> Result<Option<Frame>, TransferError> {
        self.sink_of(frame.layer).send_returning(frame)
    }

    fn flush(&mut self) -> Result<(), TransferError> {
        self.stages.iter_mut().try_for_each(|(_, s)| s.flush())?;
        self.main.flush()
    }

    fn finish(self: Box<Self>) -> Result<(), TransferError> {
        let ByLayer { main, stages } = *self;
        let mut stages = stages.into_iter();
        for (_, s) in stages.by_ref() {
            if let Err(e) = s.finish() {
                stages.for_each(|(_, s)| s.abort());
                main.abort();
                return Err(e);
            }
        }
        main.finish()
    }

    fn abort(self: Box<Self>) {
        self.stages.into_iter().for_each(|(_, s)| s.abort());
        self.main.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HandoffId, InProcess, Inboxes, KvTransport};
    use pdserve_types::KvDtype;

    fn frame(id: HandoffId, layer: u32) -> Frame {
        Frame { handoff: id, layer, index: 0, dtype: KvDtype::F16, k: vec![layer as u16], v: vec![1] }
    }

    /// Every frame reaches the receiver of its layer, and a stage's failure fails the
    /// whole handoff: the main receiver does not end well.
    #[test]
    fn frames_go_to_the_receiver_of_their_layer_and_a_stage_failure_fails_all() {
        let id = HandoffId(7);
        let (head, stage) = (Inboxes::new(16), Inboxes::new(16));
        let (mut head_in, mut stage_in) = (head.expect(id).unwrap(), stage.expect(id).unwrap());
        let open = |to: &Inboxes, token| InProcess::new(to.clone()).open(id, token).unwrap();
        let mut sink =
            Box::new(ByLayer::new(open(&head, head_in.token()), vec![(2..=3, open(&stage, stage_in.token()))]));
        (0..5).for_each(|l| sink.send(frame(id, l)).unwrap());
        sink.finish().unwrap();
        let layers = |inbox: &mut crate::Inbox| {
            std::iter::from_fn(|| inbox.blocking_recv().unwrap()).map(|f| f.layer).collect::<Vec<_>>()
        };
        assert_eq!(layers(&mut head_in), [0, 1, 4]);
        assert_eq!(layers(&mut stage_in), [2, 3]);

        let id = HandoffId(8);
        let (mut head_in, stage_in) = (head.expect(id).unwrap(), stage.expect(id).unwrap());
        let mut sink = Box::new(ByLayer::new(
            InProcess::new(head.clone()).open(id, head_in.token()).unwrap(),
            vec![(2..=3, InProcess::new(stage.clone()).open(id, stage_in.token()).unwrap())],
        ));
        sink.send(frame(id, 0)).unwrap();
        drop(stage_in);
        // Dropped unfinished after a failed send, the sink aborts the handoff.
        let sent = sink.send(frame(id, 2)).and_then(|()| sink.finish());
        assert!(sent.is_err(), "a stage gone fails the handoff");
        assert_eq!(head_in.blocking_recv().unwrap().map(|f| f.layer), Some(0));
        assert!(head_in.blocking_recv().is_err(), "the head's inbox does not end well");
    }
}
