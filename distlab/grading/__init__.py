"""`distlab grade`: instructors grade a class's lab notebooks (see `distlab.grading.grade`)."""
