"""The onnxruntime backend: each variant's ``graphs/<variant>.onnx`` replayed over the loader's own buffers.

Chosen once, at load (``--runtime onnxruntime``: ignition/runtime/backends/onnx.py); the engine, admission, frames and
presentation are the torch loader's. One ``InferenceSession`` per variant:

* the weights are the graphs' external initializers, supplied from the loader's single copy
  (``add_external_initializers``), so every session shares one set and onnxruntime never opens
  ``weights.safetensors`` itself (onnxruntime may still keep per-session derived copies: constant-
  folded transposes, pre-packed GEMM operands);
* an ``IOBinding`` built once binds every input to the loader's tensor, ``next_tokens`` to a
  tensor owned here, and each ``<buffer>.out`` to the memory of input ``<buffer>``, so outputs and
  state update in place exactly as the ``.pt2`` programs do (validate-core's ONNX-INPLACE rule is
  what makes sharing that memory safe). A replay is one ``run_with_iobinding``: no copies.

The engine fills inputs in place, so tensor addresses never change after binding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ignition.catalog.enums import Role
from ignition.catalog.model import BufferDecl
from ignition.catalog.onnx_layout import NEXT_TOKENS, expected_inputs, output_name, written_buffers

_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


class OnnxBackendError(Exception):
    """onnxruntime cannot replay this core here; the message says why."""


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


class OnnxReplay:
    """``run(buffers)`` for one variant: its session and an IOBinding over the loader's buffers."""

    def __init__(self, session, arguments: list[BufferDecl], returns: list[BufferDecl],
                 buffers: dict[str, torch.Tensor], device: torch.device):
        self.session = session
        self.binding = session.io_binding()
        self.buffers = buffers  # the bound tensors: kept alive, never reassigned
        self.tokens = returns[0].empty(device)
        kind, index = device.type, device.index or 0
        for decl in expected_inputs(arguments):
            tensor = buffers[decl.name]
            self.binding.bind_input(decl.name, kind, index, _numpy_dtype(tensor.dtype), list(tensor.shape),
                                    tensor.data_ptr())
        self.binding.bind_output(NEXT_TOKENS, kind, index, _numpy_dtype(self.tokens.dtype), list(self.tokens.shape),
                                 self.tokens.data_ptr())
        for name in written_buffers(arguments):  # in place: <buffer>.out shares <buffer>'s memory
            tensor = buffers[name]
            self.binding.bind_output(output_name(name), kind, index, _numpy_dtype(tensor.dtype), list(tensor.shape),
                                     tensor.data_ptr())

    def __call__(self, buffers) -> tuple[torch.Tensor]:
        self.session.run_with_iobinding(self.binding)
        return (self.tokens,)


class OnnxRuntimeBackend:
    """Sessions for a core's ONNX graphs on one device, sharing the loader's weights."""

    def __init__(self, root: Path, weights: dict[str, torch.Tensor], device: torch.device):
        try:
            import onnxruntime as ort
        except ImportError:
            raise OnnxBackendError("runtime 'onnxruntime' needs the onnxruntime package "
                                   "(pip install 'ignition[onnx]')") from None
        self.ort, self.root, self.device = ort, root, device
        available = ort.get_available_providers()
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise OnnxBackendError(f"device {device}: this onnxruntime has no CUDAExecutionProvider "
                                       f"(providers: {', '.join(available)}); install onnxruntime-gpu or use --device cpu")
            self.providers = [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
        else:
            self.providers = ["CPUExecutionProvider"]
        # OrtValues over the loader's tensors (no copy); sessions borrow them, so they live as long as the backend.
        self.weights = {name: ort.OrtValue.from_dlpack(tensor) for name, tensor in weights.items()}
        self.threads = torch.get_num_threads()  # the same parallelism the torch runtime gets

    def variant_run(self, entry: dict, arguments: list[BufferDecl], buffers: dict[str, torch.Tensor],
                    model: bytes) -> OnnxReplay:
        """The variant's replay from ``model``: its graph's bytes, which the loader read once, hashed and
        checked (onnxruntime parses exactly those; the core's file is not opened again)."""
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.log_severity_level = 3  # errors only
        options.add_session_config_entry(_EXTERNAL_FOLDER, str(self.root))  # where external data would be resolved
        names = [a.name for a in arguments if a.role is Role.WEIGHT]
        options.add_external_initializers(names, [self.weights[name] for name in names])
        try:
            session = self.ort.InferenceSession(model, options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own Fail/NotImplemented types
            raise OnnxBackendError(f"variant {entry['name']}: onnxruntime cannot load {entry['packages']['onnx']}: "
                                   f"{str(exc)[:400]}") from None
        returns = [BufferDecl.from_json(r) for r in entry["returns"]]
        return OnnxReplay(session, arguments, returns, buffers, self.device)
