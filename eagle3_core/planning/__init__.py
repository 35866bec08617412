"""A run's plan before it runs (`plan`): the numbers (`estimate`) and what is already done (`cached`)."""
