"""The half of an accelerated module's state (accelerate.py's `_State`) that returns outputs
lazily and runs losses in the engine: a single float output returned as a LazyOutput so that
`F.cross_entropy` on it runs model + loss as one engine graph (engine/cross_entropy.py), a
model's own loss run alone with its logits lazy (engine/model_loss.py), the deferred call run
as a plain forward when its output is read, and explain()'s look ahead at the loss graph the
first step would build. The runners of those losses are cached in `loss_runners`."""
from __future__ import annotations

import math

import torch

from ortrain._warn import first_line, warn
from ortrain.errors import OrtrainError


class LossCalls:
    """Mixed into `_State`, whose attributes (module, fuse_loss, strict, precision, device,
    runners, loss_runners, logits_read, last_key, counters) and methods (parameters, adopt,
    counting_setup, plain, autocast_covered, _fall_back) it uses."""

    def _may_defer(self, runner) -> bool:
        """Whether an output of this call may be returned lazily: training with gradients, no
        buffers updated as a side effect, no DDP around the call that needs the output's
        autograd graph (data_parallel.py), no frozen parameter under FSDP2 (which frees frozen
        parameters too after the backward pass, and a later read of the logits replays the
        forward from a copy of the trainable ones only)."""
        from ortrain import data_parallel

        return (self.fuse_loss and torch.is_grad_enabled() and self.module.training and bool(runner.trainable_params)
                and not runner.buffer_outputs and not data_parallel.outputs_traced()
                and not (runner.weights_may_be_freed and not all(p.requires_grad for p in self.parameters())))

    def _deferred(self, runner, flat, args, kwargs):
        """A LazyOutput where the loss may be fused into the engine graph (one float output), or
        the model's own loss with its logits lazy (model_loss.py); None otherwise."""
        from ortrain.engine.model_loss import splittable

        if not self._may_defer(runner) or (runner.n_user_outputs != 1 and not splittable(runner.exported.output_structure)):
            return None  # (before output_types: a planning call every step for other multi-output models)
        try:
            types = runner.output_types(flat)
        except Exception:  # noqa: BLE001 - planning errors surface on the normal path below
            return None
        if runner.n_user_outputs != 1:
            return self._model_loss(runner, flat, args, kwargs, types)
        from ortrain.engine.lazy import Deferred, LazyOutput

        (dtype, shape), = types
        if not dtype.is_floating_point or len(shape) < 2:
            return None
        from ortrain.export import unflatten_outputs

        call = Deferred(self, runner, self.last_key, flat, args, kwargs, shape, dtype)
        self.engine_calls += 1
        return unflatten_outputs(runner.exported.output_structure, [LazyOutput(call, shape)])

    def model_loss_runner(self, runner, types):
        """For a model returning its own loss and logits (Hugging Face's `labels=`): the runner
        of its graph with the loss as the only output, built on first use; None where the model
        does not return that pair or the engine would not fuse its LM head into the loss."""
        from ortrain.engine.model_loss import ModelLossRunner, split_outputs

        pair = split_outputs(runner.exported.output_structure, types)
        if pair is None:
            return None
        key = (self.last_key, "model loss")
        if key in self.logits_read:
            return None
        if key not in self.loss_runners:
            try:
                with self.counting_setup():
                    loss_runner = ModelLossRunner(self.module, runner.exported, pair[0], self.precision, self.device)
                self.loss_runners[key] = self.adopt(loss_runner) if loss_runner.fuses_lm_head() else None
            except Exception as exc:  # noqa: BLE001 - the whole graph runs, as without this
                self.loss_runners[key] = exc
        loss_runner = self.loss_runners[key]
        return None if loss_runner is None or isinstance(loss_runner, Exception) else (loss_runner, pair)

    def _model_loss(self, runner, flat, args, kwargs, types):
        """The model's own loss computed alone in the engine, its logits a LazyOutput; None
        where that does not apply."""
        found = self.model_loss_runner(runner, types)
        if found is None:
            return None
        loss_runner, (loss_index, logits_index) = found
        from ortrain._ortrain import EngineError
        from ortrain.engine.lazy import Deferred, LazyOutput
        from ortrain.export import unflatten_outputs

        dtype, shape = types[logits_index]
        call = Deferred(self, runner, self.last_key, flat, args, kwargs, shape, dtype, index=logits_index)
        key = (self.last_key, "model loss")
        # a loop that reads the logits would pay a replay of the forward pass every step: from
        # the first read on, this kind of call runs the whole graph (logits and loss) instead
        call.on_replay = lambda: self.logits_read.add(key)
        try:
            loss, = loss_runner(flat, True, seed=call.seed)
        except (EngineError, OrtrainError) as exc:
            if self.strict:
                raise
            self.loss_runners[key] = exc
            return None  # the whole graph runs, as without this
        loss_runner.last_inputs = [x.detach() for x in flat]  # for explain()
        if call.sharded:  # FSDP2 frees the parameters after this backward: a copy for a read of the logits
            loss.register_hook(call._keep_before_reshard)
        call.fused_lazily()  # the logits are computed if and when they are read
        self.engine_calls += 1
        self.model_loss_calls += 1
        outs = [None, None]
        outs[loss_index], outs[logits_index] = loss, LazyOutput(call, shape)
        return unflatten_outputs(runner.exported.output_structure, outs)

    def likely_loss_runner(self, runner, flat):
        """For explain() before the first step: the runner of the model + cross-entropy graph that
        the usual loss (`F.cross_entropy(output.view(-1, classes), target)`, mean, no slices)
        would build on the first step, built now and kept for that step (for a model returning
        its own loss and logits, its loss-only graph, model_loss.py); None where the loss would
        not be fused."""
        from ortrain.engine.cross_entropy import CrossEntropyRunner

        if not (self.fuse_loss and self.module.training and runner.trainable_params and not runner.buffer_outputs):
            return None
        try:
            types = runner.output_types(flat)
        except Exception:  # noqa: BLE001 - explain() only describes
            return None
        if runner.n_user_outputs != 1:
            found = self.model_loss_runner(runner, types)
            return None if found is None else (found[0], list(flat))
        (dtype, shape), = types
        if not dtype.is_floating_point or len(shape) < 2:
            return None
        key = (self.last_key, (), shape[-1], -100, "mean")
        if key not in self.loss_runners:
            try:
                with self.counting_setup():
                    self.loss_runners[key] = self.adopt(CrossEntropyRunner(self.module, runner.exported, (), shape[-1], -100,
                                                                           "mean", self.precision, self.device))
            except Exception:  # noqa: BLE001 - the first step reports it
                return None
        loss_runner = self.loss_runners[key]
        if isinstance(loss_runner, Exception):
            return None
        return loss_runner, list(flat) + [torch.zeros(math.prod(shape[:-1]), dtype=torch.int64)]

    def run_now(self, call) -> torch.Tensor:
        """Runs a deferred call as a plain engine forward (PyTorch if the engine fails)."""
        with self.autocast_covered():
            return self._run_now(call)

    def _run_now(self, call) -> torch.Tensor:
        from ortrain._ortrain import EngineError

        try:
            return call.runner(call.inputs, True, seed=call.seed)[call.index]
        except (EngineError, OrtrainError) as exc:
            self.runners[call.key] = exc
            self._fall_back(exc)
            from ortrain.export.outputs import flatten_outputs

            with self.plain():
                out = self.module.forward(*call.args, **call.kwargs)
            return flatten_outputs(out)[1][call.index]

    def run_cross_entropy(self, call, slices, target, ignore_index: int, reduction: str):
        """The loss of a deferred call computed in the engine with the model (None: not possible,
        the caller computes it in PyTorch)."""
        with self.autocast_covered():
            return self._run_cross_entropy(call, slices, target, ignore_index, reduction)

    def _run_cross_entropy(self, call, slices, target, ignore_index: int, reduction: str):
        from ortrain.engine.cross_entropy import CrossEntropyRunner
        from ortrain._ortrain import EngineError

        classes = call.shape[-1]
        key = (call.key, tuple(slices), classes, ignore_index, reduction)
        runner = self.loss_runners.get(key)
        if runner is None:
            try:
                runner = self.adopt(CrossEntropyRunner(self.module, call.runner.exported, slices, classes, ignore_index,
                                                       reduction, self.precision, self.device))
            except Exception as exc:  # noqa: BLE001 - the loss then runs in PyTorch
                runner = exc
                if self.strict:
                    raise OrtrainError(f"ortrain (strict): the cross-entropy cannot run in the engine: {exc}") from exc
                warn(f"ortrain: the loss runs in PyTorch (cannot fuse it into the engine: {first_line(exc)})")
            self.loss_runners[key] = runner
        if isinstance(runner, Exception):
            return None
        try:
            loss, = runner(call.inputs + [target.contiguous()], True, seed=call.seed)
        except (EngineError, OrtrainError) as exc:
            if self.strict:
                raise
            self.loss_runners[key] = exc
            warn(f"ortrain: the loss runs in PyTorch: {first_line(exc)}")
            return None
        runner.last_inputs = [x.detach() for x in call.inputs] + [target.detach()]  # for explain()
        call.move_backward_hooks(loss)
        call.fused_lazily()  # the logits are computed if and when they are read
        self.fused_loss_calls += 1
        return loss
