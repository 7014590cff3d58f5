//! Per-node timings collected over many steps (time per op type is summed from them when
//! reported), so that the next optimisation is chosen from data.

use std::collections::HashMap;
use std::time::Duration;

use crate::plan::Plan;

/// Accumulated time of one op type (or one node) in one phase.
#[derive(Clone, Debug, Default)]
pub struct OpStat {
    pub calls: u64,
    pub total: Duration,
}

/// Timings summed over every step run since the last reset.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// (phase, node index in the graph) -> time; phase is "forward" or "backward".
    pub by_node: HashMap<(&'static str, usize), OpStat>,
    /// Phases run (a training step counts one forward and one backward).
    pub phases: HashMap<&'static str, OpStat>,
}

impl Profile {
    /// Adds one phase's step timings (`(step index, duration)` as `run_phase` reports them).
    pub fn record(&mut self, plan: &Plan, phase: &'static str, timings: &[(usize, Duration)]) {
        let mut phase_total = Duration::ZERO;
        for &(i, d) in timings {
            let n = self.by_node.entry((phase, plan.steps[i].0)).or_default();
            n.calls += 1;
            n.total += d;
            phase_total += d;
        }
        let p = self.phases.entry(phase).or_default();
        p.calls += 1;
        p.total += phase_total;
    }
}
