"""Pictures as SVG (no dependency: they render in Jupyter, Colab, GitHub and browsers alike):
an array's layout on the mesh (``layout``) and the partitioned program (``program``)."""
from spmd.visual.layout import Block, Layout, layout
from spmd.visual.program import ProgramPicture, program

__all__ = ["Block", "Layout", "ProgramPicture", "layout", "program"]
