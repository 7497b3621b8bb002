"""What every runner does with a batch, given its one primitive, `layers(x, batch, start, stop)`: the residual stream
through a range of the model's layers over the paged cache. The whole forward, the first few layers alone (a
self-speculative draft) and the forward with some layers' residuals kept on the way (what EAGLE's head reads) are
the same calls in consecutive ranges, each handing its residual to the next: the same arithmetic as one call, so a
tapped forward's logits are the plain forward's."""
from __future__ import annotations

import torch

from fastdecode.layers.batch import Batch


class Runner:
    name = "runner"
    model = None

    def layers(self, x: torch.Tensor, batch: Batch, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, batch: Batch, stop: int | None = None) -> torch.Tensor:
        """-> hidden states (R, D) after layers [0, stop) (default: all), before the final norm."""
        return self.run(batch, [self.model.config.num_hidden_layers if stop is None else stop])[-1]

    @torch.inference_mode()
    def forward_taps(self, batch: Batch, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() that also returns the residual after each layer in `taps` (sorted): -> (hidden (R, D),
        taps (R, len(taps) * D))."""
        out = self.run(batch, [t + 1 for t in taps] + [self.model.config.num_hidden_layers])
        return out[-1], torch.cat(out[:-1], -1)

    def run(self, batch: Batch, bounds: list[int]) -> list[torch.Tensor]:
        """The residual after layer bound - 1 for each of the ascending `bounds`."""
        x, out, start = self.model.embed(batch.tokens), [], 0
        for stop in bounds:
            if stop > start:
                x = self.layers(x, batch, start, stop)
            out.append(x)
            start = stop
        return out
