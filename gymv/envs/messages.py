"""Messages of an episode as rows and the HTTP protocol carry them: text and image parts (images as data
URLs, decoded on demand) and the error a bad row raises. Row parsing (gymv.envs.rows) and the environment
protocol both build on these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gymv.data import images
from gymv.data.images import png_data_url
from gymv.errors import GymvError

if TYPE_CHECKING:
    from PIL import Image as PILImage


class RowError(GymvError):
    """A data row (or rollout) is unusable: the data's fault, never the model's."""


# ---------------------------------------------------------------------------------------------- content


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Image:
    """An image as a data URL (what rows and HTTP bodies carry); decoded on demand, with limits."""

    url: str
    detail: str = "auto"

    @classmethod
    def from_pil(cls, img: "PILImage.Image") -> "Image":
        return cls(png_data_url(img))

    def pil(self, *, max_pixels: int | None = None, max_bytes: int | None = None, where: str | None = None) -> "PILImage.Image":
        return images.decode_data_url(
            self.url,
            max_pixels=max_pixels or images.DEFAULT_MAX_PIXELS,
            max_bytes=max_bytes or images.DEFAULT_MAX_BYTES,
            where=where,
        )


Part = Text | Image


def parts_to_items(parts: list[Part]) -> list[dict]:
    """Content parts in the Responses-API input format."""
    out: list[dict] = []
    for p in parts:
        if isinstance(p, Text):
            out.append({"type": "input_text", "text": p.text})
        else:
            out.append({"type": "input_image", "image_url": p.url, "detail": p.detail})
    return out


@dataclass
class Message:
    role: str
    content: list[Part]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, Text))

    @property
    def images(self) -> list[Image]:
        return [p for p in self.content if isinstance(p, Image)]

    def to_item(self) -> dict:
        """A Responses-API message item; a text-only message keeps the plain-string form NeMo Gym rows use."""
        if len(self.content) == 1 and isinstance(self.content[0], Text):
            return {"role": self.role, "content": self.content[0].text}
        return {"role": self.role, "content": parts_to_items(self.content)}
